"""Store fixtures: the same tests run against local disk, memory:// and a real S3 HTTP endpoint
(moto's ThreadedMotoServer on 127.0.0.1, an ephemeral port)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    kind = request.param
    if kind == "local":
        yield str(tmp_path / "store")
    elif kind == "memory":
        yield f"memory://pt2flow-test-{uuid.uuid4().hex}"
    else:
        endpoint = request.getfixturevalue("moto_s3")
        yield f"s3://{endpoint.bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def store(store_url: str):
    from pt2flow.storage import ArtifactStore

    return ArtifactStore(store_url)
