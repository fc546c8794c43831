"""Checkpoints in object storage (issue 64): a local S3 server (moto, tests/s3_server.py), both doors.

- Knobs and pure pieces: the storage knobs' validation, a stalled upload as a named error within
  its bound, commit objects on ``memory://`` (publish, link, leftovers, removal) with no process group.
- The Trainer door (one 2-rank launch of tests/scripts/objstore_train.py): ZeRO-1/2/3 saves to
  ``s3://`` through ``ModelCheckpoint`` (stage 2 in the background, ``last`` a link object), a
  bit-for-bit resume from ``ckpt_path="last"``, and resumes at tp 2 / dp 1 at another stage.
- The Fabric door (tests/scripts/objstore_fabric.py): a 4-rank ZeRO-3 background save, loaded
  exactly by 2 ranks at ZeRO-1.
- Faults (one 2-rank launch for the matrix, one for the kill): an upload that fails or stalls after
  N bytes at every write phase, and a rank SIGKILLed mid-upload. Every save raises within a bound,
  the previous checkpoint stays the one selected and loads exactly, and the next save removes
  what the dead ones left.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import launch, launch_ranks, run_ranks, script_env
from tests.engine_state import llama_step

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(name="ckpt", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
PHASES = ("rankfile", "shard", "metadata", "meta", "commit")
STALL_S = 1.5  # the struck saves' upload_stall_s (the first save, which opens the connections, gets 30 s)
BOUND_S = 20.0  # a struck save must end (raise on every rank) within this on a loaded 2-core box


# --------------------------------------------------------------------------------------------
# Helpers shared with the scripts
# --------------------------------------------------------------------------------------------


def tiny():
    from lightning_zero.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(**CONFIG))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


step = llama_step


def dump_owned(engine, opt) -> dict:
    """``{name: (lo, hi, master, exp_avg, exp_avg_sq)}`` of what this rank owns."""
    rows = {}
    for owned in engine.owned_ranges():
        state = opt.state[engine.optimizer_tensor(owned)]
        rows[owned.name] = (owned.param_lo, owned.param_hi, owned.master.detach()[owned.chunk_lo : owned.chunk_hi].clone(),
                            state["exp_avg"].clone(), state["exp_avg_sq"].clone())  # fmt: skip
    return rows


def load_owned(url, policy, rank, world, stage=2):
    """A fresh model and engine (other initial weights) loaded from ``url``: its owned rows."""
    from lightning_zero.checkpoint import RankPlacement, apply_optimizer_state, load_model, open_checkpoint
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(123)
    model, opt = tiny()
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.01))
    layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=stage)
    opened = open_checkpoint(url, layout, policy)
    apply_optimizer_state(opened, [opt], load_model(opened, model, engine=engine, optimizers=[opt], layout=layout))
    rows = dump_owned(engine, opt)
    engine.close()
    return opened, rows


def same_rows(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        g[:2] == w[:2] and all(torch.equal(a, b) for a, b in zip(g[2:], w[2:])) for g, w in zip(
            (got[k] for k in sorted(got)), (want[k] for k in sorted(want)))
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Knobs and pure pieces
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knob,value",
    [("storage_options", "key=x"), ("upload_threads", 0), ("upload_threads", 2.5), ("upload_stall_s", 0),
     ("upload_stall_s", True)],
)  # fmt: skip
def test_storage_knobs_are_validated(knob, value):
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=knob):
        ZeroStrategy(**{knob: value})


def test_urls_stay_urls():
    from lightning_zero.checkpoint.destinations import location
    from lightning_zero.checkpoint.objstore import is_url, parent

    assert is_url("s3://b/x") and is_url("memory://x") and not is_url("/tmp/x") and not is_url("file:///tmp/x")
    assert location("s3://b/run/") == "s3://b/run" and isinstance(location("/tmp/x"), Path)
    assert parent("s3://b/run/epoch=0.ckpt") == "s3://b/run"


class _StuckFile:
    """An upload whose second part never finishes."""

    def __init__(self) -> None:
        self.parts = 0

    def write(self, data) -> None:
        self.parts += 1
        if self.parts > 1:
            threading.Event().wait()

    def close(self) -> None:
        pass


class _StuckFS:
    def open(self, path, mode, block_size=None):
        return _StuckFile()


def test_a_stalled_upload_is_a_named_error_within_its_bound():
    from lightning_zero.checkpoint.objstore import StoragePolicy, UploadStalledError, UploadStream

    policy = StoragePolicy(part_mb=5, stall_s=0.5)
    stream = UploadStream(_StuckFS(), "b/x", "s3://b/x", policy, rank=3)
    started = time.monotonic()
    with pytest.raises(UploadStalledError) as raised:
        with stream:
            for _ in range(6):  # 30 MiB: the second part stalls, the queue fills, the producer gives up
                stream.write(bytes(5 << 20))
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert "rank 3" in message and "'s3://b/x'" in message and "stalled" in message, message
    assert f"after {5 << 20} of" in message, message  # the bytes uploaded so far
    assert elapsed < 0.5 + 3.0, elapsed


def _linear_save(path, value, storage=None):
    from lightning_zero.checkpoint import RankPlacement, save_checkpoint
    from lightning_zero.checkpoint.objstore import DEFAULT_POLICY

    module = torch.nn.Linear(4, 3)
    with torch.no_grad():
        module.weight.fill_(value)
    save_checkpoint(path, {"global_step": int(value)}, module=module, engine=None, optimizers=[], layout=RankPlacement(),
                    storage=storage or DEFAULT_POLICY)  # fmt: skip


def _linear_load(path):
    from lightning_zero.checkpoint import load_model, open_checkpoint

    module = torch.nn.Linear(4, 3)
    opened = open_checkpoint(path)
    load_model(opened, module)
    return opened, float(module.weight.detach()[0, 0])


def _gcs_like(monkeypatch) -> None:
    """``gs://`` in this test is ``memory://`` (the same store) with the Google Cloud Storage rules
    our code must keep, as gcsfs applies them: writes go as a resumable upload whose chunks are
    multiples of 256 KiB (``block_size``), there is no multipart API (``call_s3``: uploads come in
    order from one writer), ``ls`` takes ``refresh``. What it does not test: gcsfs itself, GCS
    credentials, the resumable-upload protocol on the wire (docs/checkpoints.md says so)."""
    from fsspec.implementations.memory import MemoryFileSystem

    class GCSLikeMemory(MemoryFileSystem):
        protocol = ("gs", "gcs")

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, str):
                path = path.removeprefix("gs://").removeprefix("gcs://")
            return MemoryFileSystem._strip_protocol(path)

        def _open(self, path, mode="rb", block_size=None, **kwargs):
            if "w" in mode and block_size not in (None, "default"):
                assert block_size % (256 << 10) == 0, f"GCS chunks are multiples of 256 KiB, not {block_size}"
            return super()._open(path, mode, block_size=block_size, **kwargs)

        def ls(self, path, detail=True, refresh=False, **kwargs):
            return super().ls(path, detail=detail, **kwargs)

    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", GCSLikeMemory)


@pytest.mark.parametrize("protocol", ["memory", "gs"])
def test_commit_objects_publish_link_and_clean_on_memory_urls(protocol, monkeypatch):
    import fsspec

    from lightning_zero.checkpoint import is_checkpoint, objstore
    from lightning_zero.runtime.checkpoints import CheckpointLifecycle

    if protocol == "gs":
        _gcs_like(monkeypatch)
    root = f"{protocol}://lz-{os.getpid()}-{time.monotonic_ns()}"
    fs = fsspec.filesystem(protocol)
    _linear_save(f"{root}/a.ckpt", 1.0)
    first = objstore.read_commit(f"{root}/a.ckpt", objstore.DEFAULT_POLICY)["data"]
    _linear_save(f"{root}/a.ckpt", 2.0)  # the same name again: a new prefix, the old one removed after the commit
    opened, value = _linear_load(f"{root}/a.ckpt")
    assert value == 2.0 and opened.state["global_step"] == 2
    assert not fs.exists(f"{root}/a.ckpt/{first}")
    from safetensors.torch import load as load_safetensors

    from lightning_zero.checkpoint import export

    export(f"{root}/a.ckpt", f"{root}/w.safetensors")  # `lightning-zero export URL URL`
    assert float(load_safetensors(fs.cat_file(f"{root}/w.safetensors"))["weight"][0, 0]) == 2.0
    # a save that died before its commit: invisible, then removed by the next save of that name
    fs.pipe_file(f"{root}/a.ckpt/save-0123456789ab/__0_0.distcp", b"partial")
    assert _linear_load(f"{root}/a.ckpt")[1] == 2.0
    lifecycle = CheckpointLifecycle(async_checkpoint=False, stall_s=None, failed=lambda: False,
                                    is_global_zero=lambda: True)  # fmt: skip
    lifecycle.link(f"{root}/a.ckpt", f"{root}/last.ckpt")  # a link commit object, resolved by name
    assert _linear_load(f"{root}/last.ckpt")[1] == 2.0
    lifecycle.clean([root], barrier=lambda: None)
    assert not fs.exists(f"{root}/a.ckpt/save-0123456789ab")
    _linear_save(f"{root}/a.ckpt", 3.0)
    assert _linear_load(f"{root}/last.ckpt")[1] == 3.0  # the link follows the name, as a symlink does
    assert is_checkpoint(f"{root}/last.ckpt") and not is_checkpoint(f"{root}/missing.ckpt")
    lifecycle.remove(f"{root}/a.ckpt")
    assert not is_checkpoint(f"{root}/a.ckpt") and not fs.exists(f"{root}/a.ckpt")


@pytest.mark.parametrize("protocol", ["memory", "gs"])
def test_a_corrupted_shard_at_a_url_is_named_on_load(protocol, monkeypatch):
    """[Note: shard hashes on URL loads]: a shard replaced by bytes of the same size passes the
    size check; its sha256 is re-hashed on load, by the reader (a job's load) and at open
    (``export``), and the object is named."""
    import fsspec

    from lightning_zero.checkpoint import CheckpointError, RankPlacement, load_model, objstore, open_checkpoint

    if protocol == "gs":
        _gcs_like(monkeypatch)
    root = f"{protocol}://lz-{os.getpid()}-{time.monotonic_ns()}"
    _linear_save(f"{root}/a.ckpt", 1.0)
    opened = open_checkpoint(f"{root}/a.ckpt", RankPlacement())
    load_model(opened, torch.nn.Linear(4, 3))  # an intact one loads
    assert opened.reads.bytes >= sum(info["size"] for info in opened.files.values())  # every object hashed
    fs = fsspec.filesystem(protocol)
    data = objstore.resolve(f"{root}/a.ckpt", objstore.DEFAULT_POLICY)[0]
    shard = f"{data}/__0_0.distcp"
    corrupted = bytearray(fs.cat_file(shard))
    corrupted[-20] ^= 0xFF
    fs.pipe_file(shard, bytes(corrupted))
    module = torch.nn.Linear(4, 3)
    before = module.weight.detach().clone()
    opened = open_checkpoint(f"{root}/a.ckpt", RankPlacement())  # sizes match: opens
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 does not match"):
        load_model(opened, module)
    assert torch.equal(module.weight.detach(), before)  # nothing copied
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 does not match"):
        open_checkpoint(f"{root}/a.ckpt")  # export's open (no process group) hashes every object


class _Gate:
    """``gated://`` is ``memory://`` (the same store) but for the first upload whose path ends with
    ``suffix`` once armed: it reaches ``blocked`` at its close and waits there for ``release``.
    ``wrote`` is set at the first write to any ``.distcp`` object."""

    suffix = None
    blocked = threading.Event()
    release = threading.Event()
    wrote = threading.Event()


def _gated_fs():
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class GatedFile:
        def __init__(self, handle, block):
            self.handle, self.block = handle, block

        def write(self, data):
            _Gate.wrote.set()
            return self.handle.write(data)

        def close(self):
            if self.block:
                _Gate.blocked.set()
                assert _Gate.release.wait(30), "never released"
            self.handle.close()

        def __getattr__(self, name):
            return getattr(self.handle, name)

    class GatedMemory(MemoryFileSystem):
        protocol = "gated"

        def _open(self, path, mode="rb", **kwargs):
            handle = super()._open(path, mode, **kwargs)
            if "w" in mode and path.endswith(".distcp"):
                block = bool(_Gate.suffix) and path.endswith(_Gate.suffix)
                if block:
                    _Gate.suffix = None
                return GatedFile(handle, block)
            return handle

    fsspec.register_implementation("gated", GatedMemory, clobber=True)


def test_an_async_save_uploads_while_its_host_copy_runs(monkeypatch):
    """[Note: uploads overlap the host copy]: the copy of the last (smallest) tensor of a
    background save waits until a shard's bytes reached the store; it gets there only when the
    writer takes each tensor as soon as its copy is done. Then the save is published intact."""
    import types

    from lightning_zero.checkpoint import RankPlacement, background, objstore
    from lightning_zero.checkpoint.save import snapshot

    _gated_fs()
    _Gate.wrote.clear()
    url = f"gated://lz-{os.getpid()}-{time.monotonic_ns()}/a.ckpt"
    torch.manual_seed(0)
    module = torch.nn.Module()
    for index, rows in enumerate((2048, 1792, 1536)):  # 8, 7 and 6 MiB: written and copied largest first
        module.register_parameter(f"w{index}", torch.nn.Parameter(torch.randn(rows, 1024)))
    seen = []
    copy = background.HostCopy._copy

    def gated_copy(self, lives, hosts, on_device):
        if any(live.shape[0] == 1536 for live in lives):  # the second batch (the first: the largest alone)
            seen.append(_Gate.wrote.wait(10))
        copy(self, lives, hosts, on_device)

    monkeypatch.setattr(background.HostCopy, "_copy", gated_copy)
    policy = objstore.StoragePolicy(upload_threads=1, part_mb=5)
    saves = background.BackgroundSaves(storage=policy)
    taken = snapshot(url, {"global_step": 1}, module=module, engine=None, optimizers=[], layout=RankPlacement(),
                     keep_device=True)  # fmt: skip
    record = types.SimpleNamespace(step=1, advance=lambda state: None, storage=policy)
    assert saves.start(taken, RankPlacement(), time.perf_counter(), record)
    saves.wait()
    assert seen == [True]  # a shard was uploading before the host copy ended
    from lightning_zero.checkpoint import load_model, open_checkpoint

    loaded = torch.nn.Module()
    for index, rows in enumerate((2048, 1792, 1536)):
        loaded.register_parameter(f"w{index}", torch.nn.Parameter(torch.zeros(rows, 1024)))
    load_model(open_checkpoint(url, RankPlacement()), loaded)
    assert all(torch.equal(getattr(loaded, f"w{i}"), getattr(module, f"w{i}")) for i in range(3))


@pytest.mark.gpu
def test_a_host_copy_of_device_tensors_is_released_per_tensor_once_it_landed():
    """[Note: uploads overlap the host copy] on a device: the copies are non-blocking into pinned
    buffers, queued here behind 50 ms of device work, so a writer that read a buffer when the copy
    was issued (not when its event completed) would read stale bytes."""
    from lightning_zero.checkpoint.background import HostCopy

    live = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(3)}
    copy = HostCopy(live)
    assert all(host.is_pinned() for host in copy.tensors.values())
    seen = {}

    def writer():
        for name, host in copy.tensors.items():
            copy.wait_for(host)
            seen[name] = host.clone()

    thread = threading.Thread(target=writer)
    thread.start()
    torch.cuda._sleep(int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.05))
    copy.run()
    thread.join(10)
    assert seen.keys() == live.keys() and all(torch.equal(seen[k], live[k].cpu()) for k in live)


def test_two_jobs_saving_one_url_name_keep_each_others_saves_in_flight(monkeypatch):
    """[Note: two jobs, one name]: job B saves and commits the name while job A's save is in flight
    (its rank file uploaded, a shard stuck): B's cleanups leave A's prefix alone, A then commits,
    and the name loads A's save (the last commit) intact."""
    from lightning_zero.checkpoint import objstore

    _gated_fs()
    jobs = threading.local()
    monkeypatch.setattr(objstore, "job_token", lambda: getattr(jobs, "token", "aaaaaaaa"))
    root = f"gated://lz-{os.getpid()}-{time.monotonic_ns()}"
    _linear_save(f"{root}/a.ckpt", 1.0)  # job A's earlier save
    _Gate.blocked.clear(), _Gate.release.clear()
    _Gate.suffix = "__0_0.distcp"
    failures = []

    def job_a():
        try:
            _linear_save(f"{root}/a.ckpt", 2.0)
        except Exception as exc:  # noqa: BLE001 - asserted below
            failures.append(exc)

    saver = threading.Thread(target=job_a)
    saver.start()
    assert _Gate.blocked.wait(30)
    in_flight = [p for p in objstore._save_prefixes(*objstore.filesystem(f"{root}/a.ckpt"))
                 if p != objstore.read_commit(f"{root}/a.ckpt", objstore.DEFAULT_POLICY)["data"]]  # fmt: skip
    assert len(in_flight) == 1 and in_flight[0].startswith("save-aaaaaaaa-"), in_flight
    jobs.token = "bbbbbbbb"
    _linear_save(f"{root}/a.ckpt", 3.0)  # job B: begins (cleanup), writes, commits (cleanup)
    assert _linear_load(f"{root}/a.ckpt")[1] == 3.0
    assert in_flight[0] in objstore._save_prefixes(*objstore.filesystem(f"{root}/a.ckpt"))
    _Gate.release.set()
    saver.join(30)
    assert not failures, failures
    assert _linear_load(f"{root}/a.ckpt")[1] == 2.0  # A committed last: its save, whole (sha256 re-hashed)
    # B's replaced prefix is another job's for A: A's cleanups leave it (young); B's next save
    # removes it, and leaves A's (replaced now, young, another job's for B)
    (b_first,) = [n for n in objstore._save_prefixes(*objstore.filesystem(f"{root}/a.ckpt")) if "-bbbbbbbb-" in n]
    jobs.token = "aaaaaaaa"
    assert objstore.removable(b_first, now=time.time() + 2 * 86400) and not objstore.removable(b_first)
    jobs.token = "bbbbbbbb"
    _linear_save(f"{root}/a.ckpt", 4.0)
    b_now = objstore.read_commit(f"{root}/a.ckpt", objstore.DEFAULT_POLICY)["data"]
    assert objstore._save_prefixes(*objstore.filesystem(f"{root}/a.ckpt")) == sorted([in_flight[0], b_now])


class _MultipartMemory:
    """``mpu://``: ``memory://`` with S3's multipart calls (s3fs's ``call_s3``), refusing a part
    under 5 MiB that is not the last, as S3 does; ``calls`` counts them by name."""

    calls: dict = {}

    @staticmethod
    def register():
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        class MultipartMemory(MemoryFileSystem):
            protocol = "mpu"
            uploads: dict = {}

            @classmethod
            def _strip_protocol(cls, path):
                return MemoryFileSystem._strip_protocol(path.removeprefix("mpu://"))

            def split_path(self, path):
                bucket, _, key = self._strip_protocol(path).lstrip("/").partition("/")
                return bucket, key, None

            def call_s3(self, method, **kw):
                _MultipartMemory.calls[method] = _MultipartMemory.calls.get(method, 0) + 1
                if method == "create_multipart_upload":
                    upload = f"u{len(self.uploads)}"
                    self.uploads[upload] = {}
                    return {"UploadId": upload}
                if method == "upload_part":
                    self.uploads[kw["UploadId"]][kw["PartNumber"]] = bytes(kw["Body"])
                    return {"ETag": f"e{kw['PartNumber']}"}
                if method == "abort_multipart_upload":
                    self.uploads.pop(kw["UploadId"])
                    return {}
                assert method == "complete_multipart_upload", method
                stored = self.uploads.pop(kw["UploadId"])
                numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
                assert numbers == sorted(stored) == list(range(1, len(stored) + 1)), numbers
                assert all(len(stored[n]) >= 5 << 20 for n in numbers[:-1]), "EntityTooSmall"
                self.pipe_file(f"/{kw['Bucket']}/{kw['Key']}", b"".join(stored[n] for n in numbers))
                return {}

        fsspec.register_implementation("mpu", MultipartMemory, clobber=True)


@pytest.mark.parametrize("protocol", ["mpu", "memory", "gs"])
def test_no_gather_hf_export_to_a_url_is_the_local_export_byte_for_byte(protocol, tmp_path, monkeypatch):
    """[Note: no-gather Hugging Face export to a URL] in one process: files of several 8 MiB parts
    (multipart: one upload per file, its parts assembled from the runs and the header) or streamed
    in order (``memory://``, no multipart); the same bytes as the local export, the index last."""
    import fsspec

    from lightning_zero.checkpoint.dcp import DenseChunks
    from lightning_zero.checkpoint.hf import Source
    from lightning_zero.checkpoint.hf_write import HFExport, save_hf_sharded

    _MultipartMemory.register()
    _MultipartMemory.calls.clear()
    if protocol == "gs":
        _gcs_like(monkeypatch)
    torch.manual_seed(0)
    shapes = {"embed": (3000, 1024), "norm": (1024,), "head": (2000, 1024), "odd": (7, 5)}
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    # rectangles as ZeRO / TP would hold them: row blocks, one split mid-row into a flat range's pieces
    held = {name: DenseChunks(t.shape, [((0,) * t.dim(), t)]) for name, t in tensors.items()}
    held["embed"] = DenseChunks((3000, 1024), [((0, 0), tensors["embed"][:1234]), ((1234, 0), tensors["embed"][1234:])])
    export = HFExport(sources={name: Source(f"model.{name}.weight", shape) for name, shape in shapes.items()},
                      config=lambda dtype: {"torch_dtype": str(dtype)})  # fmt: skip
    local = save_hf_sharded(tmp_path / "local", export, held, max_shard_size="16MB")
    url = f"{protocol}://bucket-{os.getpid()}/hf"
    fs = fsspec.filesystem(protocol)
    fs.pipe_file(f"{url}/model.safetensors.index.json", b"stale")  # an earlier export's, removed first
    fs.pipe_file(f"{url}/model-00009-of-00009.safetensors", b"stale")
    remote = save_hf_sharded(url, export, held, max_shard_size="16MB")
    assert remote == local and len(local.files) == 2
    for path in sorted((tmp_path / "local").iterdir()):
        assert fs.cat_file(f"{url}/{path.name}") == path.read_bytes(), path.name
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False)) == sorted(
        p.name for p in (tmp_path / "local").iterdir()
    )
    if protocol == "mpu":  # files of 12.3 and 8.2 MB in 8 MiB parts (upload_part_mb): 2 + 1 parts
        assert _MultipartMemory.calls == {"create_multipart_upload": 2, "upload_part": 3,
                                          "complete_multipart_upload": 2}, _MultipartMemory.calls  # fmt: skip


# --------------------------------------------------------------------------------------------
# The fault matrix: every write phase, an upload that fails or stalls after N bytes (2 ranks)
# --------------------------------------------------------------------------------------------


def _fault_matrix(rank, world, env, url, out):
    os.environ.update(env)
    import tests.faulty_fs as faulty
    from lightning_zero.checkpoint import CheckpointWriteError, RankPlacement, save_checkpoint
    from lightning_zero.checkpoint.objstore import StoragePolicy, filesystem, join, read_commit
    from lightning_zero.config import ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    torch.manual_seed(0)
    model, opt = tiny()
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.01))
    layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=2)
    policy = StoragePolicy(upload_threads=2, stall_s=STALL_S)
    gen = torch.Generator().manual_seed(1)
    target = join(url, "ck")

    def save(global_step, storage=policy):
        save_checkpoint(target, {"global_step": global_step, "optimizer_states": []}, module=model, engine=engine,
                        optimizers=[opt], layout=layout, storage=storage)  # fmt: skip

    step(model, opt, engine, gen, rank, world)
    save(1, StoragePolicy(upload_threads=2, stall_s=30.0))
    good = dump_owned(engine, opt)
    selected = read_commit(target, policy)["data"]
    cells = []
    for phase in PHASES:
        for mode in ("fail", "stall"):
            step(model, opt, engine, gen, rank, world)
            struck = 1 if phase in ("rankfile", "shard") else 0  # rank 0 alone writes the rest
            if rank == struck:
                faulty.arm(phase, mode, 4096 if phase == "shard" else 16)
            started, error = time.monotonic(), None
            try:
                save(2)
            except CheckpointWriteError as exc:
                error = str(exc)
            seconds = time.monotonic() - started
            faulty.disarm()
            cells.append({"phase": phase, "mode": mode, "rank": struck, "error": error, "seconds": seconds,
                          "selected": read_commit(target, policy)["data"] == selected})  # fmt: skip
    # every cell left the step-1 save selected (the same commit): it resumes bit for bit
    opened, rows = load_owned(target, policy, rank, world)
    exact = opened.state["global_step"] == 1 and same_rows(rows, good)
    save(3)  # a save that goes through removes what every dead one left
    fs, inner = filesystem(target, policy)
    prefixes = sorted({p.split("/")[2] for p in fs.find(inner) if p.split("/")[2].startswith("save-")})
    # rank 1's shard replaced by bytes of the same size: re-hashed by its verifier (rank 1 % 2), the
    # load raised on every rank ([Note: shard hashes on URL loads])
    from lightning_zero.checkpoint import CheckpointError

    if rank == 0:
        shard = f"{inner}/{read_commit(target, policy)['data']}/__1_0.distcp"
        blob = bytearray(fs.cat_file(shard))
        blob[-20] ^= 0xFF
        fs.pipe_file(shard, bytes(blob))
    torch.distributed.barrier()
    corrupted = None
    try:
        load_owned(target, policy, rank, world)
    except CheckpointError as exc:
        corrupted = str(exc)
    if rank == 0:
        Path(out, "faults.json").write_text(json.dumps({"cells": cells, "exact": exact, "prefixes_after": prefixes,
                                                        "corrupted": corrupted}))  # fmt: skip
    engine.close()


@pytest.fixture(scope="module")
def fault_matrix(tmp_path_factory):
    from tests.s3_server import new_bucket

    monkeypatch = pytest.MonkeyPatch()
    try:
        bucket = new_bucket(monkeypatch)
        out = tmp_path_factory.mktemp("faults")
        url = bucket.url.replace("s3://", "faulty://")
        run_ranks(_fault_matrix, world_size=2, args=(bucket.env, url, str(out)), timeout_s=300)
        return json.loads((out / "faults.json").read_text())
    finally:
        monkeypatch.undo()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fail", "stall"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_struck_write_phase_keeps_the_previous_checkpoint(fault_matrix, phase, mode):
    cell = next(c for c in fault_matrix["cells"] if (c["phase"], c["mode"]) == (phase, mode))
    print(f"fault cell {phase}/{mode} on rank {cell['rank']}: raised after {cell['seconds']:.2f} s: {cell['error']}")
    assert cell["error"] is not None, cell  # raised on every rank (rank 0 recorded it)
    assert cell["seconds"] < BOUND_S, cell
    if mode == "stall":  # a named error: the rank, the object, the bytes so far
        assert f"rank {cell['rank']}: upload of" in cell["error"] and "stalled" in cell["error"], cell["error"]
    assert cell["selected"], cell  # the step-1 save's commit is untouched ...
    assert fault_matrix["exact"]  # ... and it resumes bit for bit (loaded after every cell struck)


@pytest.mark.slow
def test_the_next_save_removes_what_dead_saves_left(fault_matrix):
    assert len(fault_matrix["prefixes_after"]) == 1, fault_matrix["prefixes_after"]


@pytest.mark.slow
def test_a_corrupted_shard_on_2_ranks_is_named_on_every_rank(fault_matrix):
    """Rank 1's ``__1_0.distcp``, same size, one byte flipped: rank 1 re-hashes it, the load fails
    on rank 0 too (recorded there), naming the object."""
    corrupted = fault_matrix["corrupted"]
    assert corrupted is not None and "__1_0.distcp: sha256 does not match the commit" in corrupted, corrupted


# --------------------------------------------------------------------------------------------
# A rank SIGKILLed mid-upload (2 torchrun-style ranks)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_killed_mid_upload_leaves_the_previous_checkpoint(s3_bucket, tmp_path):
    from lightning_zero.checkpoint.objstore import StoragePolicy, resolve

    url = s3_bucket.url.replace("s3://", "faulty://")
    argv = [sys.executable, str(ROOT / "tests" / "scripts" / "objstore_kill.py"), str(tmp_path)]
    started = time.monotonic()
    codes, tails = launch_ranks(argv, cwd=tmp_path, env=script_env(ROOT, LZ_CKPT_URL=url), timeout_s=120, world=2,
                                log_prefix="kill")  # fmt: skip
    wall = time.monotonic() - started
    assert codes[1] == -9 and codes[0] == 0, tails
    result = json.loads((tmp_path / "kill.rank0.json").read_text())
    print(f"SIGKILL of rank 1 mid-upload: rank 0 raised after {result['seconds']:.2f} s (launch {wall:.1f} s):"
          f" {result['error']}")  # fmt: skip
    assert result["raised"] and result["seconds"] < 8.0 + BOUND_S, result  # the process group's timeout: 8 s
    # the commit still names the step-1 save (a selected save loads bit for bit: the fault matrix)
    found = resolve(f"{s3_bucket.url}/ck", StoragePolicy())
    assert found is not None and found[1]["data"] == result["selected"], (found, result)


# --------------------------------------------------------------------------------------------
# Both doors
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_door(tmp_path_factory):
    from tests.s3_server import new_bucket

    monkeypatch = pytest.MonkeyPatch()
    try:
        bucket = new_bucket(monkeypatch)
        monkeypatch.setenv("LZ_CKPT_URL", bucket.url)
        out = tmp_path_factory.mktemp("objstore_trainer")
        launch("objstore_train.py", out, "full1", "full2", "full3", "last2", "tp1to3", "tp3to2", timeout_s=400)
        return out, bucket
    finally:
        monkeypatch.undo()


def _record(out, case, rank=0):
    return torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.mark.slow
def test_trainer_resumes_from_last_in_s3_bit_for_bit(trainer_door):
    """ZeRO-2 saved in the background to s3:// every 3 steps, ``last`` a link object; a fresh fit
    from ``ckpt_path="last"`` (resolved through the commits: step 6) continues exactly."""
    out, _ = trainer_door
    for rank in (0, 1):
        full, last = _record(out, "full2", rank), _record(out, "last2", rank)
        assert last["losses"] == full["losses"][6:] and last["draws"] == full["draws"][6:]


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded", [(1, 3), (3, 2)])
def test_trainer_resumes_s3_checkpoints_at_tp2_dp1_and_another_stage(trainer_door, tmp_path, saved, loaded):
    """Saved at dp 2 (stage 1 / 3), resumed at tp 2 x dp 1 (stage 3 / 2): the first loss equals one
    process evaluating the saved weights (exported straight from s3://) on that batch."""
    from safetensors.torch import load_file

    from lightning_zero.checkpoint import export
    from lightning_zero.models.llama import Llama, LlamaConfig, cross_entropy_loss

    out, bucket = trainer_door
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in bucket.env.items():
            monkeypatch.setenv(key, value)
        exported = export(f"{bucket.url}/s{saved}/epoch=0-step=3.ckpt", tmp_path / "w.safetensors")
    model = Llama(LlamaConfig(**CONFIG))
    model.load_state_dict(load_file(str(exported)))
    record = _record(out, f"tp{saved}to{loaded}")
    batch = record["first_batch"]
    with torch.no_grad():
        want = cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:]).item()
    assert record["losses"][0] == pytest.approx(want, rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_fabric_saves_zero3_on_4_ranks_to_s3_and_loads_at_zero1_on_2_exactly(s3_bucket, tmp_path):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("LZ_CKPT_URL", s3_bucket.url)
        launch("objstore_fabric.py", tmp_path, "save3", timeout_s=400, ranks=4)
        launch("objstore_fabric.py", tmp_path, "resume1@fab3w4", timeout_s=400, ranks=2)
    saved = torch.load(tmp_path / "save3w4.rank0.pt", weights_only=False)["at_save"]
    for rank in (0, 1):
        loaded = torch.load(tmp_path / f"resume1w2@fab3w4.rank{rank}.pt", weights_only=False)["loaded"]
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_hydra_checkpoint_dir_takes_a_url(tmp_path):
    """``lightning-zero train checkpoint.dir=s3://... strategy.storage_options=...``: the run's
    ``ModelCheckpoint`` writes there, and the strategy reaches the store with those options."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.cli import build_trainer
    from lightning_zero.hydra_config import compose, validate

    cfg = validate(compose(["checkpoint.dir=s3://bucket/run", "trainer.devices=1",
                            "strategy.storage_options={client_kwargs:{endpoint_url:'http://127.0.0.1:9'}}"]))  # fmt: skip
    trainer = build_trainer(cfg, tmp_path)
    (checkpoint,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert checkpoint.dirpath == "s3://bucket/run"
    storage = trainer.strategy.checkpoints.storage
    assert storage.storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert type(storage.storage_options["client_kwargs"]) is dict  # plain dicts for fsspec, not DictConfig
