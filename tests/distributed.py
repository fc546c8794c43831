"""Run a function on N gloo ranks on CPU and fail with the rank's traceback, never hang.

Usage in a test::

    def _body(rank: int, world_size: int, out_dir: str) -> None:
        ...  # torch.distributed is initialized (gloo) when this runs

    def test_something(tmp_path):
        run_ranks(_body, world_size=2, args=(str(tmp_path),))

``_body`` must be a module-level function (it is pickled: the ranks are started by
multiprocessing's ``forkserver``, see ``_rank_context``).

A Lightning script (``tests/scripts/``) runs as ``launch(script, out_dir, *args, ranks=2)``: every
rank at once, as torchrun starts them (``launch_ranks``), each forked from the fork server, which
imported torch and Lightning once for the whole session ([Note: test fork server] in
tests/fork_server.py). ``start_process`` starts one such process (tests that time or kill ranks).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The fork server imports this module with Python's default sys.path (3.11's forkserver ignores the
# parent's): put this checkout's src first, as conftest.py does, so ranks run the code under test.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lightning_zero.ports import free_port  # noqa: E402, F401  (tests import it from here)


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


def _rank_context() -> Any:
    """multiprocessing's ``forkserver``, preloaded with torch: each rank is forked from a process
    that imported torch once per session (spawn re-imported it, 3-5 s of CPU per rank), and still
    starts clean (the server never ran a torch op, never held a process group); ``fn`` and its
    arguments are pickled as under ``spawn``. ``LZ_TEST_FORK_SERVER=0``: plain ``spawn``."""
    if os.environ.get("LZ_TEST_FORK_SERVER", "1") == "0":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.distributed"])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` with gloo initialized."""
    ctx = _rank_context()
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


ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Starting script processes: forked from the fork server ([Note: test fork server]) or plain
# --------------------------------------------------------------------------------------------

# Variables read when torch or Lightning are imported: a child whose value differs from the fork
# server's is started as a plain process (the server imported them under its own values).
_IMPORT_TIME_VARS = ("PYTHONPATH", "OMP_", "MKL_", "TORCH_", "PL_", "LIGHTNING_", "CUDA_", "PYTORCH_")
_server: Any = None  # None: not started yet; False: unavailable (plain processes)


class ForkedProcess:
    """A process the fork server started: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, argv: list[str], conn: socket.socket, pid: int) -> None:
        self.args, self.pid, self.returncode = argv, pid, None
        self._conn, self._pending = conn, b""

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self._conn], [], [], max(0.0, timeout))
        if not ready:
            return
        chunk = self._conn.recv(256)
        if not chunk:
            raise RuntimeError(f"the tests' fork server died while pid {self.pid} ran (tests/fork_server.py)")
        self._pending += chunk
        if b"\n" in self._pending:
            self.returncode = int(self._pending.split()[1])
            self._conn.close()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(left)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _fork_server() -> Any:
    """The session's fork server: (process, socket path, its environment), started on first use."""
    global _server
    if _server is None:
        _server = False
        if os.environ.get("LZ_TEST_FORK_SERVER", "1") == "0":
            return _server
        where = tempfile.mkdtemp(prefix="lz_fork_server_")
        path, env = os.path.join(where, "socket"), script_env(ROOT)
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_server.py"), path], cwd=where, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        if not ready or proc.stdout.readline().strip() != b"ready":
            proc.kill()
            warnings.warn("the tests' fork server did not start: every rank is a plain process", stacklevel=2)
            return _server
        atexit.register(shutil.rmtree, where, True)
        atexit.register(proc.stdin.close)  # its stdin closing is its signal to exit (runs first)
        _server = (proc, path, env)
    return _server


def _forkable(argv: list[str], env: dict, server_env: dict) -> bool:
    if len(argv) < 2 or argv[0] != sys.executable or not (argv[1].endswith(".py") or argv[1] == "-m" and len(argv) > 2):
        return False
    keys = {key for key in (*env, *server_env) if key.startswith(_IMPORT_TIME_VARS)}
    return all(env.get(key) == server_env.get(key) for key in keys)


def start_process(argv: list[str], *, cwd, env: dict, log_path) -> Any:
    """Start ``argv`` (``[sys.executable, SCRIPT, ...]`` or ``[sys.executable, "-m", MODULE, ...]``) in ``cwd`` with exactly ``env``, in its own
    session, stdout and stderr into ``log_path``. Forked from the fork server when it can be (same
    behaviour from the script's first line on, without re-importing torch and Lightning), else a
    ``subprocess.Popen``. Either way the result has ``pid``, ``poll``, ``wait``, ``kill`` and
    ``returncode`` as Popen has."""
    argv = [str(arg) for arg in argv]
    server = _fork_server()
    if server and _forkable(argv, env, server[2]):
        request = {"argv": argv, "cwd": str(cwd), "env": dict(env), "log": str(log_path)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server[1])
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                raise RuntimeError("the tests' fork server closed the connection before forking")
            answer += chunk
        kind, value = answer.decode().strip().split(" ", 1)
        if kind == "pid":
            return ForkedProcess(argv, conn, int(value))
        conn.close()
        warnings.warn(f"the tests' fork server refused ({value}): a plain process instead", stacklevel=2)
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def torchrun_env(env: dict, rank: int, world: int, port: int) -> dict:
    """``env`` plus what torchrun gives local rank ``rank`` of a one-node ``world``: Lightning then
    starts no processes of its own and takes the ranks from the environment."""
    return dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world), NODE_RANK="0")  # fmt: skip


def launch_ranks(argv: list[str], *, cwd, env: dict, timeout_s: float, world: int = 2,
                 log_prefix: str = "launch") -> tuple[list[Optional[int]], str]:  # fmt: skip
    """Start ``world`` ranks of ``argv`` at once as torchrun would (``torchrun_env``), each in its
    own session; wait at most ``timeout_s``, then kill every rank's process group. Returns the exit
    codes (None: killed) and the tail of each rank's output (``CWD/<log_prefix>.rank<r>.log``)."""
    port = free_port()
    logs = [Path(cwd) / f"{log_prefix}.rank{rank}.log" for rank in range(world)]
    procs = [
        start_process(argv, cwd=cwd, env=torchrun_env(env, rank, world, port), log_path=logs[rank])
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    codes: list[Optional[int]] = []
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:  # also when interrupted (pytest-timeout, Ctrl-C): never leave a rank behind
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    tails = []
    for rank, log_path in enumerate(logs):
        text = log_path.read_text(errors="replace")
        tails.append(f"--- rank {rank} (exit {codes[rank]}) ---\n{text[-3000:]}")
    return codes, "\n".join(tails)


def launch(script: str, out_dir, *args: str, timeout_s: float, ranks: int = 2) -> None:
    """Run ``tests/scripts/<script> OUT_DIR ARGS...`` (a Lightning script for ``ranks`` devices) as
    ``ranks`` torchrun-style processes from ``out_dir``; fail with the tail of each rank's output
    if any exits non-zero or the launch times out."""
    argv = [sys.executable, str(ROOT / "tests" / "scripts" / script), str(out_dir), *map(str, args)]
    codes, tails = launch_ranks(argv, cwd=out_dir, env=script_env(ROOT), timeout_s=timeout_s, world=ranks,
                                log_prefix=Path(script).stem)  # fmt: skip
    assert codes == [0] * ranks, f"{script}: exit codes {codes} (None: killed after {timeout_s:.0f} s)\n{tails}"


def launch_each(script: str, out_dir, launches: list[tuple[int, list[str]]], *, timeout_s: float):
    """:func:`launch` of ``script`` once per ``(devices, cases)`` of ``launches`` (each case a run the
    script trains in sequence on that many ranks); returns ``out_dir``."""
    for devices, cases in launches:
        launch(script, out_dir, devices, *cases, timeout_s=timeout_s, ranks=devices)
    return out_dir


def rank_result(results, case: str, rank: int = 0) -> Any:
    """What a script wrote for ``case`` on ``rank``: ``OUT_DIR/<case>.rank<rank>.pt``."""
    return torch.load(Path(results) / f"{case}.rank{rank}.pt")


def joined_ranks(results, case: str, ranks: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A run's per-step losses and validation losses, the mean over its ``ranks`` ranks (each reports
    its dp rank's batch: the mean is the global batch's in every layout), and every parameter (under
    pp each rank holds its stages'; ranks holding the same stage hold the same values)."""
    reports = [rank_result(results, case, rank) for rank in range(ranks)]
    params: dict = {}
    for report in reports:
        params.update(report["params"])
    losses = torch.tensor([report["losses"] for report in reports]).mean(0)
    return losses, torch.tensor([report["val_losses"] for report in reports]).mean(0), params


def assert_same_params(got: dict, want: dict, tol: float = 1e-5) -> None:
    """Two results' ``params`` (name -> tensor) hold the same names and values within ``tol``
    (relative and absolute, as the parity tables state it)."""
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=name)
