"""benchmarks/gpu_check.py --dry-run: every phase of the GPU check that needs no CUDA, on CPU
(tiny Llama, gloo), with omegaconf and hydra unimportable as on the lent GPU machine.

Not a GPU test: it keeps the one prepared script a GPU session runs from rotting, so a lent
GPU's minutes are not spent on a broken script (docs/gpu.md).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The lent machine has neither: importing them must fail inside the check as it would there.
WITHOUT_HYDRA = (
    "import runpy, sys\n"
    "sys.modules['omegaconf'] = None\n"
    "sys.modules['hydra'] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_gpu_check_dry_run_runs_every_phase_and_writes_its_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("LIGHTNING_ZERO_WIRE_ONE_RANK", None)
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_HYDRA, script, "--dry-run", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    errors = {name: phase.get("error") for name, phase in report["phases"].items() if not phase["ok"]}
    assert proc.returncode == 0 and report["ok"], (errors, proc.stdout[-2000:], proc.stderr[-3000:])
    phases = report["phases"]
    assert list(phases) == [
        "preflight", "probes", "runs", "forced", "offload_clip_monitor", "zero3_offload_accum_ckpt",
        "uninitialized_fill", "profile", "async_checkpoint", "muon",
    ]  # fmt: skip
    # Muon through matrix owners: torch.optim.Muon's steps bit for bit, the owner exchanges ran
    muon = phases["muon"]
    assert muon["max_abs_vs_torch_muon"] == 0.0 and muon["owner_exchange_calls"]["muon_to_owner"] > 0, muon
    assert muon["optimizer_step_s_median"]["muon"] > 0 and muon["muon_over_adamw"] > 0, muon
    assert phases["preflight"]["versions"]["omegaconf"] is None and phases["preflight"]["versions"]["hydra"] is None
    assert all(phases["probes"]["checks"].values())
    runs = phases["runs"]["runs"]
    assert set(runs) == {"single", "zero1", "zero2", "zero3"}
    for kind, run in runs.items():
        assert len(run["losses"]) == 3 and all(math.isfinite(loss) for loss in run["losses"]), kind
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, kind
        assert run["predicted_memory"]["total"] > 0, kind
        assert not run.get("comm_calls"), (kind, run.get("comm_calls"))  # dp=1 short-circuits
    for kind in ("zero1", "zero2", "zero3"):
        # bf16-mixed, same weights and rows: the engine's bf16 parameters vs Lightning's autocast
        assert phases["runs"]["vs_single"][kind]["max_rel"] < 1e-2, phases["runs"]["vs_single"][kind]
        # [Note: one rank on the wire]: real collectives, and the same losses to the bit
        forced = phases["forced"]["runs"][kind]
        assert forced["comm_calls"].get("reduce_scatter_grads", 0) > 0, forced["comm_calls"]
        assert phases["forced"]["vs_short_circuit"][kind]["max_abs"] == 0.0
    assert phases["zero3_offload_accum_ckpt"]["run"]["finite"]
    assert any("reduce_scatter" in key for key in phases["profile"]["profile"])
    saves = phases["async_checkpoint"]
    assert saves["tensor_files"] > 0 and saves["differing_files"] == [], saves
    assert len(saves["save_stall_s"]["sync"]) == len(saves["save_stall_s"]["async"]) > 0, saves
