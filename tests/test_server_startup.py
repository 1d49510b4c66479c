"""While the model loads the port is already open: liveness holds, readiness and the API answer 503."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from governor import contract
from governor.engine.server.app import ServerState, create_app
from governor.engine.server.metrics import EngineMetrics
from governor.engine.server.serve import scope_of


def loading_client() -> TestClient:
    state = ServerState(EngineMetrics("m", "r1"), "m", "/models/m", admin_token="t")
    return TestClient(create_app(state))


def test_health_is_ok_and_ready_is_503_while_loading() -> None:
    client = loading_client()
    assert client.get("/health").status_code == 200
    r = client.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "starting"}


def test_api_calls_while_loading_get_503_with_retry_after() -> None:
    client = loading_client()
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable" and "loading" in r.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 503
    assert client.get("/admin/knobs", headers={"authorization": "Bearer t"}).status_code == 503


def test_metrics_are_served_while_loading_without_engine_info() -> None:
    text = loading_client().get("/metrics").text
    assert 'governor_requests_finished_total{finish_reason="length",model_name="m",namespace="",revision="r1"} 0.0' \
        in text
    assert "governor_engine_info{" not in text


def test_metrics_carry_the_namespace_from_the_flag_else_the_env() -> None:
    env = {contract.REVISION_ENV: "r-env", contract.NAMESPACE_ENV: "team-env"}
    assert scope_of(None, None, env) == ("r-env", "team-env")
    assert scope_of("r-flag", "team-flag", env) == ("r-flag", "team-flag")  # the flags win
    assert scope_of(None, None, {}) == ("", "")  # a standalone engine
    state = ServerState(EngineMetrics("m", *scope_of(None, "team-flag", env)), "m", "/models/m", admin_token=None)
    text = TestClient(create_app(state)).get("/metrics").text
    assert ('governor_requests_finished_total{finish_reason="length",model_name="m",namespace="team-flag",'
            'revision="r-env"} 0.0') in text


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    proc = subprocess.run([sys.executable, "-m", "governor.engine", "serve", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert "is not supported" in proc.stderr and "LlamaForCausalLM" in proc.stderr
