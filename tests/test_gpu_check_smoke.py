"""benchmarks/gpu_check.py --smoke: the GPU check's plumbing on CPU (tiny Llama, 3 steps, gloo).

Not a GPU test: it checks that the one prepared script a GPU session runs works end to end and
writes its JSON (losses of zero1/2/3 beside Lightning's single-device run, step times, memory
predictions, tokens/s and MFU), so a lent GPU's minutes are not spent on a broken script.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_writes_its_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 1 and set(report["runs"]) == {"single", "zero1", "zero2", "zero3"}
    for kind, run in report["runs"].items():
        assert len(run["losses"]) == 3 and all(math.isfinite(loss) for loss in run["losses"]), kind
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, kind
        assert run["predicted_memory"]["total"] > 0, kind
    for kind in ("zero1", "zero2", "zero3"):
        # bf16-mixed, same weights and rows: the engine's bf16 parameters vs Lightning's autocast
        assert report["vs_single"][kind]["loss_max_rel_diff"] < 1e-2, report["vs_single"][kind]
        assert report["vs_single"][kind]["step_time_vs_single"] > 0
