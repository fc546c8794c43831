"""A local S3 server for tests: moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port), dummy
credentials, one bucket per test. Processes a test starts reach it through the environment
(``AWS_ENDPOINT_URL`` and the dummy keys, read by s3fs/botocore as real credentials are), so the
same ``s3://`` URL works in the test process and in every rank. Only loopback traffic."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

import pytest

_server = None


@dataclass(frozen=True)
class Bucket:
    url: str  # s3://<bucket>
    env: dict  # what a process needs to reach the server

    def storage_options(self) -> dict:
        return {"client_kwargs": {"endpoint_url": self.env["AWS_ENDPOINT_URL"]}, "key": "testing",
                "secret": "testing"}  # fmt: skip


def endpoint() -> str:
    """Start the session's server once; its ``http://127.0.0.1:<port>``."""
    global _server
    if _server is None:
        pytest.importorskip("s3fs")
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        _server = server
    host, port = _server.get_host_and_port()
    return f"http://{host}:{port}"


def server_env() -> dict:
    return {"AWS_ENDPOINT_URL": endpoint(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def new_bucket(monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket; this process's environment points at the server for the test's duration."""
    env = server_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import fsspec

    name = f"lz-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return Bucket(f"s3://{name}", env)


def environ_with(env: dict) -> dict:
    return {**os.environ, **env}
