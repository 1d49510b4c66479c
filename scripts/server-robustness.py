"""What a huge request costs everyone else: /health latency and a running stream's inter-chunk gaps while
`governor serve` refuses a 50 MB body, a 5 MB prompt of words and a 15 MB prompt without whitespace (the worst case:
tokenized whole), and the server's RSS before and after.

    python scripts/server-robustness.py [--out results.json]

Starts its own server on 127.0.0.1 with a generated tiny model (CPU) and prints one JSON object."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from governor.cli import main as governor_main


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(url: str, pid: int, payload: bytes) -> dict[str, Any]:
    """Send `payload` as a completion body while a stream runs and /health is polled; the worst gaps of each."""
    gaps: list[float] = []
    health: list[float] = []
    result: dict[str, Any] = {}
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": "m", "prompt": "hello", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    streaming.set()

    def big() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", content=payload, headers={"content-type": "application/json"},
                       timeout=120)
        result.update(status=r.status_code, seconds=round(time.monotonic() - t0, 3),
                      message=r.json()["error"]["message"][:120])

    streamer = threading.Thread(target=stream)
    streamer.start()
    streaming.wait(60)
    rss_before = rss_mib(pid)
    sender = threading.Thread(target=big)
    sender.start()
    while sender.is_alive():
        t0 = time.monotonic()
        httpx.get(f"{url}/health", timeout=60)
        health.append(time.monotonic() - t0)
        time.sleep(0.02)
    streamer.join()
    time.sleep(0.5)
    return dict(result, health_max_s=round(max(health), 3), health_polls=len(health),
                stream_gap_max_s=round(max(gaps[1:]), 3), stream_gap_median_s=round(sorted(gaps)[len(gaps) // 2], 4),
                rss_before_mib=round(rss_before, 1), rss_after_mib=round(rss_mib(pid), 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        governor_main(["make-model", str(model), "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32"])
        port = 18431
        proc = subprocess.Popen([sys.executable, "-m", "governor.engine", "serve", str(model), "--port", str(port),
                                 "--max-model-len", "2048", "--num-kv-blocks", "512"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            words = "the quick brown fox " * 250_000  # 5 MB of words: refused after a probe of its head
            solid = "x" * (15 * 2**20)  # 15 MiB without whitespace: no probe, tokenized whole
            huge = "word " * (10 * 2**20)  # 50 MiB: over the body limit
            out = {name: measure(url, proc.pid, json.dumps({"model": "m", "prompt": text}).encode())
                   for name, text in (("50 MB body", huge), ("5 MB prompt of words", words),
                                      ("15 MB prompt without whitespace", solid))}
        finally:
            proc.terminate()
            proc.wait(30)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
