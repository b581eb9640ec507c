"""A local S3-compatible server for object-store tests: moto's server mode on a random
loopback port, with the standard AWS environment pointing at it.

    server = moto_s3.start()          # skips the test when moto is not installed
    os.environ.update(server.env)     # or monkeypatch.setenv for each
    uri = server.uri("run-a")         # s3://<bucket>/run-a
    server.stop()
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import uuid
from typing import Any

import pytest

MISSING = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
SKIP_REASON = f"object-store tests need moto[server] and s3fs ({', '.join(MISSING)} missing)"


@dataclasses.dataclass
class S3Server:
    server: Any
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{name or uuid.uuid4().hex}"

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def keys(self, prefix: str) -> list[str]:
        """Every object key under `prefix` (a URI or a key prefix)."""
        prefix = prefix.removeprefix(f"s3://{self.bucket}/")
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def stop(self) -> None:
        self.server.stop()


def start() -> S3Server:
    if MISSING:
        pytest.skip(SKIP_REASON)
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # One line per request.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(server, f"http://{host}:{port}", f"bucket-{uuid.uuid4().hex[:8]}")
    s3.client().create_bucket(Bucket=s3.bucket)
    return s3


def use(s3: S3Server, monkeypatch: Any) -> None:
    """Points this process's AWS environment (and fresh fsspec clients) at `s3`."""
    import s3fs  # type: ignore[import-untyped]

    from jaxlearn.checkpoint import storage

    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    storage.check_backend.cache_clear()
