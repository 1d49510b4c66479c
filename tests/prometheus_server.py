"""A real Prometheus for tests: the binary of Debian's `prometheus` package, on 127.0.0.1 and a free port.

`start_prometheus` writes its own config (one job, `governor`, scraping static targets) and a TSDB under a
temporary directory, and stops the process on the way out. No system service is used or touched. A missing
binary fails the test with how to install it: the project's setup (scripts/setup.sh) installs it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from governor.tuner.prom import duration
from tests.test_server import free_port, wait_until

DEBIAN_BINARY = Path("/usr/bin/prometheus")
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
JOB = "governor"


@dataclass
class PromServer:
    """A running Prometheus: `url` is its base URL (`http://127.0.0.1:port`), `log` its stdout and stderr."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def query(self, promql: str) -> list[dict[str, object]]:
        """An instant query's result vector (asserts that Prometheus answered it)."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        assert r.status_code == 200, f"{promql}: HTTP {r.status_code} {r.text[:300]}"
        result: list[dict[str, object]] = r.json()["data"]["result"]
        return result


def prometheus_binary() -> str:
    """Path of the Prometheus binary; fails the test, saying how to install it, when there is none."""
    found = shutil.which("prometheus") or (str(DEBIAN_BINARY) if DEBIAN_BINARY.exists() else None)
    if found is None:
        pytest.fail("Prometheus is not installed (no `prometheus` on PATH, no /usr/bin/prometheus). "
                    "Run `bash scripts/setup.sh`, or install it yourself: `apt-get install -y prometheus` "
                    "(Debian/Ubuntu), then run the tests again.", pytrace=False)
    return found


def write_config(path: Path, targets: list[str], scrape_interval_s: float) -> None:
    """A Prometheus config: global scrape and evaluation interval, one job scraping `targets` (host:port).

    Written as JSON, which is YAML too.
    """
    interval = duration(scrape_interval_s)
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics", "static_configs": [{"targets": targets}]}],
    }
    path.write_text(json.dumps(config, indent=2))


@contextlib.contextmanager
def start_prometheus(targets: list[str], tmp_dir: Path, scrape_interval_s: float = 1.0) -> Iterator[PromServer]:
    """Run Prometheus scraping `targets` (`host:port`, path /metrics) every `scrape_interval_s`; yields once
    `/-/ready` answers 200 (at most 30 s), then stops it (SIGTERM, then SIGKILL after 10 s)."""
    binary = prometheus_binary()
    port = free_port()
    config = tmp_dir / "prometheus.yml"
    write_config(config, targets, scrape_interval_s)
    log = tmp_dir / f"prometheus-{port}.log"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_dir / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = PromServer(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode} before it was ready:\n{server.log_tail()}")
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "Prometheus' /-/ready", timeout=READY_TIMEOUT_S)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
