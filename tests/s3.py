"""A real S3 HTTP endpoint for tests: moto's ThreadedMotoServer bound to 127.0.0.1, port 0."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from collections.abc import Iterator

import pytest


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    bucket: str
    env: dict[str, str]


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Endpoint]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "pt2flow-test-key",
        "AWS_SECRET_ACCESS_KEY": "pt2flow-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    bucket = "pt2flow-test"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    try:
        yield S3Endpoint(url, bucket, env)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
