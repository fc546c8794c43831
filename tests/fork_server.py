"""A fork server for the tests' multi-process scripts: import torch and Lightning once, fork each rank.

[Note: test fork server] Importing ``lightning.pytorch`` costs 10-13 s of CPU per process on the
2-core CI machine (torchmetrics pulls in transformers and scipy, Lightning's wrappers pull in
``torch._dynamo``), and the multi-process tests start well over a hundred such processes: a third
of ``.ci/run`` was imports. This server (started once per pytest session by
``tests.distributed.start_process``) imports them once, then forks a child per request, and the
child runs the script exactly as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would from
there on:

- its own session (``setsid``: the tests kill a rank's process group), working directory,
  environment (replaced whole, plus what the server's imports set in theirs, as the child's own
  imports would have), stdin from /dev/null and stdout+stderr into the requested log;
- ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them for a script, and Lightning's
  ``rank_zero_only.rank`` recomputed from the child's environment (Lightning reads it at import);
- the script runs as ``__main__`` at this file's top level, so an exception leaves it the way it
  leaves a script (traceback on stderr, exit code 1), ``sys.exit`` keeps its code, and interpreter
  shutdown (atexit, non-daemon threads, finalizers) is the ordinary one: the rank-failure tests
  time exactly that exit path.

Only ``torch`` and ``lightning`` are imported ahead; ``lightning_zero`` (the code under test) is
imported fresh by each child. The server forks only while it has a single thread (true with
``OMP_NUM_THREADS=1``, which the tests' environment sets); otherwise it refuses and the client
starts a plain process instead. ``LZ_TEST_FORK_SERVER=0`` turns it off for a whole run.

Protocol over a Unix socket, one connection per child: the client sends one JSON line
``{"argv", "cwd", "env", "log"}``; the server answers ``pid N`` after the fork (or ``refused
WHY``) and ``exit CODE`` when the child ends (``CODE`` as ``Popen.returncode``: negative for a
signal). The server exits when its stdin closes (the pytest process ended).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys

PRELOAD = ("torch", "lightning.pytorch")


class _RunScript(BaseException):
    """Raised in a forked child to unwind out of the server loop and run the script at top level."""

    def __init__(self, script: str) -> None:
        super().__init__(script)
        self.script = script


def _single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def _become_child(request: dict, sockets: list[socket.socket]) -> None:
    """In the forked child: take on the request's process state, then run the script (raises)."""
    os.setsid()
    for sock in sockets:
        sock.close()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    target, *args = request["argv"][1:]  # argv[0] is the interpreter
    if target == "-m":  # python -m MODULE ARGS: runpy sets sys.argv[0] to the module's file
        target, *args = args
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
        target = "-m " + target
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # what Lightning's import computes from this environment
    raise _RunScript(target)


def serve(path: str) -> None:
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    # What the imports wrote into the environment (Lightning: PYTORCH_NVML_BASED_CUDA_CHECK, torch:
    # TORCHINDUCTOR_CACHE_DIR): a child's own environment gets it too, as its own imports would give.
    import_env = {key: value for key, value in os.environ.items() if before.get(key) != value}
    gc.freeze()  # the imported objects: children's collections skip them (no copy-on-write of their pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    reading: dict[socket.socket, bytes] = {}  # connections whose request line is still arriving
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([listener, stdin, *reading], [], [], 0.05)  # 0.05: how soon exits are reported
        if stdin in ready and not os.read(stdin, 1024):
            return  # the pytest process is gone
        if listener in ready:
            conn, _ = listener.accept()
            reading[conn] = b""
        for conn in [c for c in ready if c in reading]:
            chunk = conn.recv(1 << 16)
            reading[conn] += chunk
            if not chunk or b"\n" in reading[conn]:
                line = reading.pop(conn)
                if not chunk and b"\n" not in line:
                    conn.close()
                    continue
                request = json.loads(line.split(b"\n", 1)[0])
                if not _single_threaded():
                    conn.sendall(b"refused the server has more than one thread\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    request["env"] = {**import_env, **request["env"]}
                    _become_child(request, [listener, *reading, *children.values(), conn])
                children[pid] = conn
                conn.sendall(f"pid {pid}\n".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the client gave up on it
            conn.close()


if __name__ == "__main__":
    _script = None
    try:
        serve(sys.argv[1])
    except _RunScript as run:
        _script = run.script
    if _script is not None:  # a forked child; outside the except block, so no exception context
        import runpy

        if _script.startswith("-m "):
            _script_globals = runpy.run_module(_script[3:], run_name="__main__", alter_sys=True)
        else:
            _script_globals = runpy.run_path(_script, run_name="__main__")  # kept alive as __main__'s are
