import os
import sys
from pathlib import Path

# Test the checkout these tests live in, whatever copy of the package pip installed last.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep every test process small: 2 cores are shared by all ranks.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def s3_bucket(monkeypatch):
    """A bucket of the session's local S3 server (tests/s3_server.py)."""
    from tests.s3_server import new_bucket

    return new_bucket(monkeypatch)
