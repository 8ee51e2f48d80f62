"""A bounded schemathesis run against the live server (real uvicorn, real Ray cluster): requests
generated from the OpenAPI document, valid and invalid, get no server error, only documented
status codes and bodies that match the schema, and leak no KV block."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pdserve.cluster import Cluster
from pdserve.router.app import build_app

from helpers import Server

OPERATIONS = r"^/(v1/|tokenize|detokenize|version|health)"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster.start(decode=1, mode="colocated", max_model_len=64)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def api_schema(cluster):
    server = Server(build_app(cluster, max_body_bytes=64 << 10))
    yield schemathesis.openapi.from_url(server.url + "/openapi.json").include(path_regex=OPERATIONS)
    server.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_openapi_document_holds(case):
    case.call_and_validate()


def test_no_block_leaked_after_the_fuzz(cluster):
    rows = cluster.status()
    assert rows and all(r["request_blocks"] == 0 and r["inflight"] == 0 for r in rows), rows
