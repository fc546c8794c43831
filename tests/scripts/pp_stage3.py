"""ZeRO-3 inside pipeline stages, for tests/test_pipeline_stage3.py: one 4-rank launch of both doors.

Usage: python tests/scripts/pp_stage3.py OUT_DIR 4 CASE [CASE ...]
A case named ``fabric-<schedule>-zero3`` is tests/scripts/fabric_pp.py's hand loop at pp=2 x dp=2
(written as OUT_DIR/<schedule>-zero3.rank<r>.pt); any other is tests/scripts/pp_parity.py's Trainer case.
"""

import sys

from tests.scripts import fabric_pp, pp_parity

if __name__ == "__main__":
    out, devices = sys.argv[1], int(sys.argv[2])
    for case in sys.argv[3:]:
        if case.startswith("fabric-"):
            fabric_pp.main(out, case.removeprefix("fabric-"), devices)
        else:
            pp_parity.run(case, devices, out)
