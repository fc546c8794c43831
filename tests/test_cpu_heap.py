"""[Note: glibc's thresholds on CPU]: an engine built on CPU keeps a step's transients on the heap.

Each case runs in a fresh process (this one's thresholds moved long ago). The process first frees
one 8 MiB block, as a first step's logits do (glibc's thresholds are then 8 and 16 MiB), then
allocates and frees one 24 MiB tensor, as a step does with its logits-sized ones. ``mallinfo2``
says where glibc put it: ``hblkhd``, the bytes glibc has mmapped (the tensor, unless the mmap
threshold is above it), and ``fordblks``, the bytes it holds free once the tensor is freed (the
tensor's, unless glibc gave them back to the OS: then the next step faults them in again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_zero.zero.cpu_heap import uses_glibc

pytestmark = pytest.mark.skipif(not uses_glibc(), reason="glibc's dynamic mmap and trim thresholds")

MIB = 1 << 20

STEP_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from lightning_zero.zero.cpu_heap import mallinfo2

torch.set_num_threads(1)
torch.empty(8 << 20, dtype=torch.uint8).fill_(1)  # a first step's freed logits
if sys.argv[1] == "engine":
    from lightning_zero.config import ZeroConfig
    from lightning_zero.ports import free_port
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = torch.nn.Linear(8, 8)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())], ZeroConfig(stage=1))
before = mallinfo2()
transient = torch.ones(6 << 20)  # 24 MiB that a step allocates and frees, as logits-sized tensors are
mapped = mallinfo2()["hblkhd"] - before["hblkhd"]
del transient
kept_free = mallinfo2()["fordblks"] - before["fordblks"]
print(json.dumps({"kept_free": kept_free, "mapped": mapped}))
"""


def _where_glibc_put_a_step(case: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    done = subprocess.run(
        [sys.executable, "-c", STEP_SCRIPT, case], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_engine_on_cpu_raises_glibc_thresholds_so_a_step_stays_on_the_heap():
    plain = _where_glibc_put_a_step("plain")
    if plain["mapped"] < 24 * MIB:
        pytest.skip(f"this allocator did not mmap a 24 MiB tensor after an 8 MiB one was freed: {plain}")
    assert plain["kept_free"] < 8 * MIB, plain  # unmapped when freed: the next step maps and faults it anew
    with_engine = _where_glibc_put_a_step("engine")
    assert with_engine["mapped"] == 0, with_engine  # from the heap: the mmap threshold is 32 MiB now
    # and kept there for the next step (less what small blocks took of it)
    assert with_engine["kept_free"] >= 20 * MIB, with_engine
