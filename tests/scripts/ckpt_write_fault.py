"""A rank SIGKILLed while a checkpoint is being written (launched by tests/test_checkpoint_faults.py).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python ckpt_write_fault.py OUT_DIR STAGE

Both ranks train a tiny Llama with ``ZeroEngine`` (gloo, 20 s timeout), save ``OUT_DIR/last.ckpt``
after step 1 (rank 0 dumps the weights to ``good.pt``), train step 2 and save ``last.ckpt`` again;
rank 1 kills itself once its shards are written, before the checkpoint is published. Rank 0 writes
``rank0.json``: whether the save raised, how long it took, and the error.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from lightning_zero import checkpoint  # noqa: E402
from lightning_zero.checkpoint import save as checkpoint_save  # noqa: E402
from lightning_zero.config import ZeroConfig
from lightning_zero.models.llama import Llama, LlamaConfig  # noqa: E402
from lightning_zero.zero.engine import ZeroEngine  # noqa: E402
from tests.engine_state import llama_step  # noqa: E402

CONFIG = dict(name="ckpt", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def main(out: Path, stage: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, bucket_mb=0.01))
    layout = checkpoint.RankPlacement(world_size=world, rank=rank, dp_size=world, dp_rank=rank, stage=stage)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        llama_step(model, opt, engine, gen, rank, world)

    def save(global_step: int) -> None:
        checkpoint.save_checkpoint(out / "last.ckpt", {"global_step": global_step, "optimizer_states": []},
                                   module=model, engine=engine, optimizers=[opt], layout=layout)  # fmt: skip

    step()
    save(1)
    good = {
        r.name: (r.param_lo, r.param_hi, r.master.detach()[r.chunk_lo : r.chunk_hi].clone())
        for r in engine.owned_ranges()
    }
    torch.save(good, out / f"good.rank{rank}.pt")
    step()

    def die(stage_name: str) -> None:
        if stage_name == "shards_written" and rank == 1:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_save._fault_hook = die
    start = time.monotonic()
    result = {"raised": False, "error": None}
    try:
        save(2)
    except BaseException as exc:  # noqa: BLE001 - whatever the surviving rank sees is the result
        result = {"raised": True, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    result["seconds"] = time.monotonic() - start
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the peer is gone: no process-group teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
