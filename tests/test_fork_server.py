"""The tests' fork server starts a script as ``python SCRIPT ARGS`` would ([Note: test fork server]).

Every multi-process Lightning test runs its ranks through it, so what a rank sees (argv, path,
working directory, environment, Lightning's rank, its session) and how it ends (exit code,
traceback, a signal) must be a plain interpreter's: the probe script runs both ways, forked and
as a plain process, and what it sees is compared; the ways it ends are a plain interpreter's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from tests.distributed import ROOT, ForkedProcess, _fork_server, script_env, start_process, torchrun_env

PROBE = textwrap.dedent(
    """
    import json, os, sys, threading
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    mode = sys.argv[1]
    state = {
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
        "env": dict(os.environ),
        "rank_zero": rank_zero_only.rank, "session_leader": os.getsid(0) == os.getpid(),
        "stdin": sys.stdin.read(), "threads": threading.active_count(),
        "lightning_zero_loaded": "lightning_zero" in sys.modules,
    }
    with open(os.path.join(os.getcwd(), f"{mode}.json"), "w") as out:
        json.dump(state, out)
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "raise":
        raise ValueError("a bad batch")
    if mode == "exit3":
        sys.exit(3)
    if mode == "hang":
        import time
        time.sleep(600)
    """
)


def _run(tmp_path, mode: str, forked: bool):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cwd = tmp_path / ("forked" if forked else "plain")
    cwd.mkdir(exist_ok=True)
    env = dict(torchrun_env(script_env(ROOT), rank=1, world=2, port=12345), LZ_FORK_PROBE="only in this child")
    argv = [sys.executable, str(script), mode]
    log = cwd / f"{mode}.log"
    if forked:
        proc = start_process(argv, cwd=cwd, env=env, log_path=log)
        assert isinstance(proc, ForkedProcess), "the fork server did not start this one"
    else:
        import subprocess

        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, cwd, log


@pytest.fixture(scope="module", autouse=True)
def _server():
    if os.environ.get("LZ_TEST_FORK_SERVER", "1") == "0" or not _fork_server():
        pytest.skip("the fork server is off (LZ_TEST_FORK_SERVER=0) or did not start")


def test_a_forked_script_sees_what_a_plain_one_sees(tmp_path):
    states = {}
    for forked in (True, False):
        proc, cwd, log = _run(tmp_path, "ok", forked)
        assert proc.wait(timeout=120) == 0, log.read_text()
        states[forked] = json.loads((cwd / "ok.json").read_text())
        assert "to stdout" in log.read_text() and "to stderr" in log.read_text()
    state, plain = states[True], states[False]
    for key in ("argv", "path0", "main", "env", "rank_zero", "stdin", "threads"):
        assert state[key] == plain[key], (key, state[key], plain[key])
    assert state["cwd"].endswith("forked") and plain["cwd"].endswith("plain")
    assert state["session_leader"] and state["rank_zero"] == 1 and state["main"] == "__main__"
    assert state["env"]["LZ_FORK_PROBE"] == "only in this child" and state["env"]["RANK"] == "1"
    assert not state["lightning_zero_loaded"]  # the code under test is imported fresh by each rank


@pytest.mark.parametrize("mode, code", [("raise", 1), ("exit3", 3)])
def test_a_forked_script_ends_as_a_plain_one(tmp_path, mode, code):
    """An uncaught exception: its traceback on stderr and exit code 1; ``sys.exit(3)``: 3."""
    proc, _, log = _run(tmp_path, mode, True)
    assert proc.wait(timeout=120) == code, log.read_text()
    output = log.read_text()
    if mode == "raise":
        assert "Traceback (most recent call last)" in output and "ValueError: a bad batch" in output
        assert "During handling" not in output, output  # no exception context from the server


def test_a_forked_module_runs_as_python_dash_m_runs_it(tmp_path):
    """``python -m MODULE ARGS``: ``sys.argv[0]`` is the module's file, ``sys.path[0]`` the working
    directory, ``__name__`` is ``"__main__"``."""
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = torchrun_env(script_env(ROOT), rank=0, world=1, port=12345)
    proc = start_process([sys.executable, "-m", "probe_mod", "ok"], cwd=tmp_path, env=env, log_path=tmp_path / "m.log")
    assert isinstance(proc, ForkedProcess)
    assert proc.wait(timeout=120) == 0, (tmp_path / "m.log").read_text()
    state = json.loads((tmp_path / "ok.json").read_text())
    assert state["argv"] == [str(tmp_path / "probe_mod.py"), "ok"], state["argv"]
    assert state["path0"] == str(tmp_path) and state["main"] == "__main__" and state["rank_zero"] == 0


def test_killing_a_forked_rank_s_group_reports_the_signal(tmp_path):
    proc, cwd, _ = _run(tmp_path, "hang", True)
    deadline = time.monotonic() + 60
    while not (cwd / "hang.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
