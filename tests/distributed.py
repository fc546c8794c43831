"""Run a function on N gloo ranks on CPU and fail with the rank's traceback, never hang.

Usage in a test::

    def _body(rank: int, world_size: int, out_dir: str) -> None:
        ...  # torch.distributed is initialized (gloo) when this runs

    def test_something(tmp_path):
        run_ranks(_body, world_size=2, args=(str(tmp_path),))

``_body`` must be a module-level function (it is pickled by the ``spawn`` start method).
"""

from __future__ import annotations

import os
import socket
import subprocess
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, timeout_s: float, args: tuple, errors) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down gloo while a peer still talks to it
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` with gloo initialized."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(target=_entry, args=(rank, fn, world_size, port, timeout_s, args, errors), daemon=True)
        proc.start()
        procs.append(proc)
    try:
        for proc in procs:
            proc.join(timeout_s + 30)
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        messages = []
        while not errors.empty():
            rank, tb = errors.get()
            messages.append(f"--- rank {rank} ---\n{tb}")
        if messages:
            raise AssertionError("distributed test failed:\n" + "\n".join(messages))
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s + 30:.0f}s")
        bad = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with non-zero codes: {bad}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def script_env(root, **extra: str) -> dict:
    """Environment for a Lightning script launched from a test: the checkout on the path, one
    thread per rank, and none of the launcher variables an earlier test may have left behind
    (they would make Lightning think it runs under torchrun or SLURM and wait forever)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARS and not key.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))
    }
    env.update(PYTHONPATH=f"{root}{os.pathsep}{root / 'src'}", OMP_NUM_THREADS="1", **extra)
    return env


def run_script(argv: list[str], *, cwd, env: dict, timeout_s: float) -> "subprocess.CompletedProcess[str]":
    """Run a multi-process Lightning script in its own session; on timeout kill the whole group.

    Lightning's launcher starts rank 1 as a child of the script: killing only the script would
    leave that rank behind, blocked in a collective.
    """
    import signal

    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[run_script] killed after {timeout_s:.0f}s"
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def launch(script: str, out_dir, *args: str, timeout_s: float) -> None:
    """Run ``tests/scripts/<script> OUT_DIR ARGS...`` (a Lightning multi-process script) from
    ``out_dir``; fail with the tail of its output if it exits non-zero or times out."""
    import sys

    proc = run_script(
        [sys.executable, str(ROOT / "tests" / "scripts" / script), str(out_dir), *map(str, args)],
        cwd=out_dir,
        env=script_env(ROOT),
        timeout_s=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
