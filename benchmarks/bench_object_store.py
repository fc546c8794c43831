"""Sharded saves and loads against a shaped local S3 server: stock DCP ``FsspecWriter`` vs ours.

    python benchmarks/bench_object_store.py [--mb 24] [--latency-ms 20] [--mb-per-s 1] [--threads 8] [--out FILE]

A moto S3 server runs in a subprocess behind a throttling WSGI wrapper written here: every request
first waits ``latency-ms``, then its body (up) and its response (down) each move at ``mb-per-s``
(per request, as one S3 connection is limited while parallel requests add up). The server counts
the bytes it sent back, so "bytes fetched" is what the store really served.

Why 1 MB/s per request by default: the shaping must be what limits, not the moto server's own CPU
(one Python process: on the 2-core, heavily shared benchmark box 8 parallel 4 MiB PUTs unshaped
moved ~11 MiB/s in total), so ``threads x mb-per-s`` stays below that; a real store's per-connection
rate is higher, and so is what parallel requests add up to.

The checkpoint: ``--mb`` MiB of fp32 tensors, each saved as two row halves (the rectangles two dp
ranks would write), by one process with the same planner for both writers:

- stock: ``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter(url, thread_count=1,
  sync_files=False)`` (DCP's default thread count; ``sync_files=True`` raises on s3fs streams,
  pytorch #142396) and ``FsspecReader`` over s3fs;
- ours: ``checkpoint/objstore_dcp.py``'s ``ObjectWriter`` (``--threads`` objects uploaded at once
  in 8 MiB parts) plus the commit object, and ``ObjectReader`` (the byte ranges of the items asked
  for, fetched in parallel).

Loads: every tensor whole ("full"), then the first half of every tensor ("share": what dp rank 0
of 2 holds). Prints a table and writes benchmarks/results/object_store.json.

Background saves (``--async-rounds``, [Note: uploads overlap the host copy] in
``checkpoint/background.py``): the same tensors as a module's parameters, saved through
``BackgroundSaves`` to the shaped server, then ``--async-local-mb`` MiB to a local directory (a
fast sink, where the copy is a larger part of the save). "before": the host copy taken whole
before the writer starts (a ``HostCopy`` that copies when made: what a local save does, and what
a URL save did before); "after": the writer started first, each tensor written once copied (what
a URL save does; for the local directory forced with ``overlap_local``, to show why it is off). Per save: seconds until training may
resume (``start`` returned) and until published (``wait`` returned). The sides alternate in one
process (ABAB, then BABA; each side keeps its buffers from save to save, as a run does), and the
report is each side's median with a bootstrap 95% interval of the ratio after / before
(``interleaved_ab.ratio_interval``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# The shaped server (``--serve``: runs in its own process)
# --------------------------------------------------------------------------------------------


class Throttle:
    """WSGI wrapper: ``latency_s`` per request, then ``bytes_per_s`` for its body and its response;
    ``GET /__stats__`` returns the bytes served so far, ``POST /__reset__`` zeroes them."""

    def __init__(self, app, latency_s: float, bytes_per_s: float) -> None:
        self.app, self.latency_s, self.bytes_per_s = app, latency_s, bytes_per_s
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "bytes_in": 0, "bytes_out": 0}

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/__stats__":
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps(self.stats).encode()]
        if path == "/__reset__":
            with self.lock:
                self.stats = {"requests": 0, "bytes_in": 0, "bytes_out": 0}
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        time.sleep(self.latency_s)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            body = environ["wsgi.input"].read(length)
            environ["wsgi.input"] = io.BytesIO(body)
            time.sleep(len(body) / self.bytes_per_s)
        response = b"".join(self.app(environ, start_response))
        time.sleep(len(response) / self.bytes_per_s)
        with self.lock:
            self.stats["requests"] += 1
            self.stats["bytes_in"] += length
            self.stats["bytes_out"] += len(response)
        return [response]


def serve(port_file: str, latency_s: float, bytes_per_s: float) -> None:
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = Throttle(DomainDispatcherApplication(create_backend_app), latency_s, bytes_per_s)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


def _stats(endpoint: str, reset: bool = False) -> dict:
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/__reset__", method="POST") if reset else f"{endpoint}/__stats__"
    with urllib.request.urlopen(request) as response:
        body = response.read()
    return {} if reset else json.loads(body)


def _tensors(total_mb: int, count: int = 8):
    import torch

    rows = 256
    cols = total_mb * (1 << 20) // 4 // count // rows
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(count)}


def _halves(tensors: dict, which: tuple[int, ...], fill: bool):
    """``{name: DenseChunks}`` of the row halves ``which`` (0, 1) of each tensor (copies when not
    ``fill``: load targets)."""
    import torch

    from lightning_zero.checkpoint.dcp import DenseChunks

    out = {}
    for name, tensor in tensors.items():
        half = tensor.shape[0] // 2
        pieces = []
        for index in which:
            part = tensor[index * half : (index + 1) * half]
            pieces.append(((index * half, 0), part.clone() if fill else torch.zeros_like(part)))
        out[name] = DenseChunks(tensor.shape, pieces)
    return out


def run(args: argparse.Namespace) -> dict:
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from lightning_zero.checkpoint import objstore
    from lightning_zero.checkpoint.dcp import ChunkLoadPlanner, ChunkSavePlanner
    from lightning_zero.checkpoint.destinations import ObjectDestination
    from lightning_zero.checkpoint.objstore import StoragePolicy
    from lightning_zero.checkpoint.objstore_dcp import ObjectReader
    from lightning_zero.checkpoint.targets import RankPlacement

    port_file = Path(f"/tmp/lz_bench_s3_{uuid.uuid4().hex[:8]}")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), "--latency-ms",
                               str(args.latency_ms), "--mb-per-s", str(args.mb_per_s)])  # fmt: skip
    try:
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port_file.read_text()}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
        fsspec.filesystem("s3", use_listings_cache=False).mkdir("bench")
        tensors = _tensors(args.mb)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        share_bytes = nbytes // 2
        options = {"config_kwargs": {"read_timeout": 600}}  # a shaped 32 MiB PUT takes longer than botocore's 60 s
        policy = StoragePolicy(storage_options=options, upload_threads=args.threads)
        results: dict = {"settings": {"mb": nbytes / 2**20, "latency_ms": args.latency_ms,
                                      "mb_per_s_per_request": args.mb_per_s, "threads": args.threads}}  # fmt: skip

        def timed(label: str, fn) -> None:
            _stats(endpoint, reset=True)
            started = time.perf_counter()
            fn()
            seconds = time.perf_counter() - started
            served = _stats(endpoint)
            results[label] = {"seconds": seconds, "requests": served["requests"], "bytes_up": served["bytes_in"],
                              "bytes_fetched": served["bytes_out"]}  # fmt: skip

        def stock_save() -> None:
            writer = FsspecWriter("s3://bench/stock", thread_count=1, sync_files=False, **options)
            dcp.save(_halves(tensors, (0, 1), True), storage_writer=writer, planner=ChunkSavePlanner(), no_dist=True)

        def ours_save() -> None:
            dest = ObjectDestination("s3://bench/ours", RankPlacement(), None, None, policy)
            dcp.save(_halves(tensors, (0, 1), True), storage_writer=dest.storage_writer(), planner=ChunkSavePlanner(),
                     no_dist=True)  # fmt: skip
            objstore.commit("s3://bench/ours", dest.save_id, dest.files(), policy)

        def load(reader_of, which) -> None:
            def go() -> None:
                targets = _halves(tensors, which, False)
                dcp.load(targets, storage_reader=reader_of(), planner=ChunkLoadPlanner(), no_dist=True)
                for name, value in targets.items():  # every byte read back is the saved one
                    half = tensors[name].shape[0] // 2
                    for (row, _), piece in value.pieces:
                        assert torch.equal(piece, tensors[name][row : row + half]), name

            return go

        # both clients warm (a run's first save pays for its session, as its first request does): steady state
        fsspec.core.url_to_fs("s3://bench/stock", **options)[0].ls("bench")
        objstore.filesystem("s3://bench/ours", policy)[0].ls("bench")
        timed("stock_save", stock_save)
        timed("ours_save", ours_save)
        data = objstore.resolve("s3://bench/ours", policy)[0]
        timed("stock_load_full", load(lambda: FsspecReader("s3://bench/stock", **options), (0, 1)))
        timed("ours_load_full", load(lambda: ObjectReader(data, policy), (0, 1)))
        timed("stock_load_share", load(lambda: FsspecReader("s3://bench/stock", **options), (0,)))
        timed("ours_load_share", load(lambda: ObjectReader(data, policy), (0,)))
        results["checkpoint_bytes"], results["share_bytes"] = nbytes, share_bytes
        if args.async_rounds:
            import tempfile

            run_async(args, lambda name: f"s3://bench/{name}", args.mb, "s3", results)
            with tempfile.TemporaryDirectory() as local:
                run_async(args, lambda name: str(Path(local, name)), args.async_local_mb, "local", results)
        return results
    finally:
        server.kill()
        server.wait()
        port_file.unlink(missing_ok=True)


def run_async(args: argparse.Namespace, url_of: Any, mb: int, label: str, results: dict) -> None:
    """Interleaved background saves, before vs after (the module's docstring)."""
    import types

    import torch

    from lightning_zero.checkpoint import background
    from lightning_zero.checkpoint.objstore import StoragePolicy
    from lightning_zero.checkpoint.save import snapshot
    from lightning_zero.checkpoint.targets import RankPlacement

    original = background.HostCopy

    class CopyFirst(original):  # "before": the whole copy, then the writer
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            original.run(self)

        def run(self) -> None:
            return None

    module = torch.nn.Module()
    for name, tensor in _tensors(mb).items():
        module.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor))
    policy = StoragePolicy(storage_options={"config_kwargs": {"read_timeout": 600}}, upload_threads=args.threads)
    sides = {"before": background.BackgroundSaves(storage=policy), "after": background.BackgroundSaves(storage=policy)}
    sides["after"].overlap_local = True  # a local target copies first unless told (the Note says why)
    times: dict[str, dict[str, list]] = {side: {"resume_s": [], "published_s": []} for side in sides}
    order = [("before", "after"), ("after", "before")] * args.async_rounds
    for index, pair in enumerate(order[: args.async_rounds]):
        for side in pair:
            background.HostCopy = CopyFirst if side == "before" else original
            try:
                url = url_of(f"{label}-{side}-{index}")
                taken = snapshot(url, {"global_step": index}, module=module, engine=None, optimizers=[],
                                 layout=RankPlacement(), keep_device=True)  # fmt: skip
                record = types.SimpleNamespace(step=index, advance=lambda state: None, storage=policy)
                started = time.perf_counter()
                sides[side].start(taken, RankPlacement(), started, record)
                resumed = time.perf_counter()
                sides[side].wait()
                published = time.perf_counter()
            finally:
                background.HostCopy = original
            times[side]["resume_s"].append(resumed - started)
            times[side]["published_s"].append(published - started)
    from interleaved_ab import ratio_interval

    out = {"mb": mb, "saves_per_side": len(times["after"]["resume_s"]), **times}
    for key in ("resume_s", "published_s"):
        out[f"{key}_ratio"] = ratio_interval(times["before"][key], times["after"][key])
    results[f"async_{label}"] = out


def report_async(results: dict) -> list[str]:
    import statistics

    lines = []
    for label in ("s3", "local"):
        row = results.get(f"async_{label}")
        if row is None:
            continue
        lines.append(f"background save, {label} ({row['mb']} MiB, {row['saves_per_side']} saves a side, interleaved):")
        for key, what in (("resume_s", "training may resume"), ("published_s", "published")):
            before, after = statistics.median(row["before"][key]), statistics.median(row["after"][key])
            ratio, lo, hi = row[f"{key}_ratio"]
            lines.append(f"  {what:20} before {before:7.3f} s   after {after:7.3f} s   after/before {ratio:.3f}"
                         f" [{lo:.3f}, {hi:.3f}]")  # fmt: skip
    return lines


def report(results: dict) -> str:
    nbytes, share = results["checkpoint_bytes"], results["share_bytes"]
    lines = [
        f"{results['settings']['mb']:.0f} MiB checkpoint, {results['settings']['latency_ms']} ms per request,"
        f" {results['settings']['mb_per_s_per_request']} MB/s per request, upload_threads={results['settings']['threads']}",
        f"{'':18}{'stock DCP Fsspec':>20}{'lightning_zero':>18}{'ratio':>8}",
    ]
    for what, wanted in (("save", nbytes), ("load_full", nbytes), ("load_share", share)):
        stock, ours = results[f"stock_{what}"], results[f"ours_{what}"]
        stock_rate, ours_rate = wanted / stock["seconds"] / 2**20, wanted / ours["seconds"] / 2**20
        lines.append(f"{what + ' MiB/s':18}{stock_rate:>20.1f}{ours_rate:>18.1f}{ours_rate / stock_rate:>7.1f}x")
        results[f"{what}_ratio"] = ours_rate / stock_rate
    for what in ("load_full", "load_share"):
        stock, ours = results[f"stock_{what}"], results[f"ours_{what}"]
        wanted = nbytes if what == "load_full" else share
        lines.append(f"{what + ' fetched':18}{stock['bytes_fetched'] / wanted:>19.2f}x{ours['bytes_fetched'] / wanted:>17.2f}x"
                     f"   (of the {wanted / 2**20:.0f} MiB asked for)")  # fmt: skip
    lines.append(f"{'save requests':18}{results['stock_save']['requests']:>20}{results['ours_save']['requests']:>18}")
    return "\n".join(lines + report_async(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=24, help="checkpoint MiB")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every request")
    parser.add_argument("--mb-per-s", type=float, default=1.0, help="MB/s of one request's body or response")
    parser.add_argument("--threads", type=int, default=8, help="upload_threads of ours")
    parser.add_argument("--async-rounds", type=int, default=4, help="background saves per side (0: none)")
    parser.add_argument("--async-local-mb", type=int, default=256, help="MiB of the local-directory background saves")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "object_store.json"), help="JSON")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.latency_ms / 1000, args.mb_per_s * 1e6)
        return
    sys.path.insert(0, str(ROOT / "src"))
    results = run(args)
    print(report(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
