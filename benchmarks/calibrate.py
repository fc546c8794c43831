"""Measure this machine into a hardware config for the planner (same as `lightning-zero plan calibrate`).

    python benchmarks/calibrate.py --out benchmarks/results/cpu_calibrated.yaml
    python benchmarks/calibrate.py --quick --out /tmp/hw.yaml     # seconds: small sizes, tiny model

See ``lightning_zero/planner/calibrate.py`` for what is measured and docs/planner.md for how the
step-time model uses it.
"""

from lightning_zero.planner.calibrate import main

if __name__ == "__main__":
    main()
