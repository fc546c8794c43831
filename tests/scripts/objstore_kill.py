"""A rank SIGKILLed mid-upload of its shards (launched by tests/test_object_store.py).

Usage: LZ_CKPT_URL=faulty://bucket RANK=r WORLD_SIZE=2 ... python objstore_kill.py OUT_DIR

Both ranks train tests/test_checkpoint.py's tiny Llama with ZeroEngine (stage 2, gloo, 8 s
timeout), save ``<url>/ck`` after step 1, train step 2 and save ``<url>/ck`` again; rank 1 SIGKILLs itself 4096 bytes into uploading a shard
(tests/faulty_fs.py). Rank 0 writes ``OUT_DIR/kill.rank0.json``: whether the save raised, how long
it took, the error, and the save id the commit named before.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

import tests.faulty_fs  # noqa: E402,F401  (registers faulty://, arms LZ_FAULT on its rank)
from lightning_zero.checkpoint import CheckpointWriteError, RankPlacement, save_checkpoint  # noqa: E402
from lightning_zero.checkpoint.objstore import StoragePolicy, read_commit  # noqa: E402
from lightning_zero.config import ZeroConfig  # noqa: E402
from lightning_zero.zero.engine import ZeroEngine  # noqa: E402
from tests.test_object_store import step, tiny  # noqa: E402


def main(out: Path, url: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=8))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, opt = tiny()
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, bucket_mb=0.01))
    layout = RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=2)
    policy = StoragePolicy(upload_threads=2, stall_s=5.0)
    gen = torch.Generator().manual_seed(1)

    def save(global_step: int) -> None:
        save_checkpoint(f"{url}/ck", {"global_step": global_step, "optimizer_states": []}, module=model,
                        engine=engine, optimizers=[opt], layout=layout, storage=policy)  # fmt: skip

    step(model, opt, engine, gen, rank, world)
    tests.faulty_fs.disarm()  # the first save goes through
    save(1)
    selected = read_commit(f"{url}/ck", policy)["data"]
    step(model, opt, engine, gen, rank, world)
    if rank == 1:
        tests.faulty_fs.arm("shard", "kill", 4096)
    start = time.monotonic()
    result = {"raised": False, "error": None}
    try:
        save(2)
    except CheckpointWriteError as exc:
        result = {"raised": True, "error": str(exc)[:1500]}
    result["seconds"], result["selected"] = time.monotonic() - start, selected
    (out / f"kill.rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the peer is gone: no process-group teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]), os.environ["LZ_CKPT_URL"])
