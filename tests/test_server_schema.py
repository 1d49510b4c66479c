"""Schemathesis against the live server's own OpenAPI schema: no generated request gets a 5xx.

Covers POST /v1/completions, POST /v1/chat/completions and every GET endpoint (PUT /admin/knobs is
left out: it changes the server). Examples per operation are bounded so the file runs in well under
a minute on two cores; a small max_model_len keeps each valid generation short.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.test_server import Server, start_server

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def schema_server(hf_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(hf_checkpoint("qwen3"), "--served-model-name", MODEL, "--max-model-len", "96",
                      "--num-kv-blocks", "64", "--max-num-seqs", "4", "--drain-grace-s", "1",
                      log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(schema_server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{schema_server.url}/openapi.json")


# Filters go on the lazy schema: the one pytest runs is built from the fixture with these filters.
schema = schemathesis.pytest.from_fixture("api_schema").include(method="GET").include(method="POST",
                                                                                       path_regex="^/v1/")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_server_error(case: schemathesis.Case) -> None:
    # A random model name stops every request at the 404; the served one lets generated bodies reach the
    # engine (unknown models are tested in test_server.py).
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    case.call_and_validate(checks=[not_a_server_error], timeout=30)
