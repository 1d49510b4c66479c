"""The engine under a read-only root filesystem, as the operator renders its pods: every file it writes while it
loads a model, serves completions, metrics and a knob change, and drains lies where the operator's environment
(`api.WRITABLE_ENV`, and TMPDIR, i.e. the pod's /tmp emptyDir) points, never elsewhere.

Python's audit hooks see every file the interpreter and its libraries open for writing, every directory they
make and every rename; the engine runs as `governor serve` in a child process with the hook installed first.
(CPU only: on a GPU, Triton's and CUDA's caches follow the same variables, TRITON_CACHE_DIR and HOME.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from governor.cli import main as governor_main
from governor.operator.pod_ownership import TMP_DIR, WRITABLE_ENV
from tests.test_server import free_port, wait_until

# Appends one JSON line per write-like event to the file in GOVERNOR_TEST_WRITES, then runs the CLI.
HOOK = r"""
import json, os, sys
log = open(os.environ["GOVERNOR_TEST_WRITES"], "a", buffering=1)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = any(c in (mode or "") for c in "wax+") if mode is not None else bool((flags or 0) & WRITE)
        if writes and isinstance(path, (str, bytes, os.PathLike)):
            log.write(json.dumps([event, os.fsdecode(path)]) + "\n")
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "os.symlink", "os.link"):
        if isinstance(args[0], (str, bytes, os.PathLike)):
            log.write(json.dumps([event, os.fsdecode(args[0])]) + "\n")

sys.addaudithook(hook)
from governor.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_engine_writes_only_where_the_operator_points_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    assert governor_main(["make-model", str(model), "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32"]) == 0
    pod_tmp = tmp_path / "pod-tmp"  # the pod's /tmp emptyDir
    pod_tmp.mkdir()
    token = tmp_path / "token"
    token.write_text("t0ken")
    writes = tmp_path / "writes.jsonl"
    env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(pod_tmp),
           "GOVERNOR_TEST_WRITES": str(writes),
           **{k: v.replace(TMP_DIR, str(pod_tmp), 1) for k, v in WRITABLE_ENV.items()}}
    port = free_port()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOOK, "serve", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--dtype", "float32",
                             "--admin-token-file", str(token), "--drain-grace-s", "2"],
                            env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, proc), "the engine's /ready", timeout=90)
        r = httpx.post(f"{url}/v1/completions", json={"model": "model", "prompt": "Hello", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        r = httpx.put(f"{url}/admin/knobs", json={"max_num_seqs": 8}, timeout=10,
                      headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    events = [json.loads(line) for line in writes.read_text().splitlines()]
    outside = [e for e in events if not (e[1].startswith(str(pod_tmp)) or e[1].startswith("/dev/"))
               and e[1] != str(writes)]
    assert outside == [], f"the engine wrote outside the pod's writable directories: {outside}"
    assert proc.returncode == 0


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"the engine exited with {proc.returncode}"
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        time.sleep(0.1)
        return False


def test_the_audit_hook_sees_what_a_command_writes(tmp_path: Path) -> None:
    """The check above would pass on a hook that saw nothing: `make-model` writes a checkpoint, and the hook sees it."""
    writes = tmp_path / "writes.jsonl"
    out = tmp_path / "written-model"
    subprocess.run([sys.executable, "-c", HOOK, "make-model", str(out), "--arch", "qwen3", "--preset", "tiny"],
                   env={**os.environ, "GOVERNOR_TEST_WRITES": str(writes)}, check=True, capture_output=True,
                   timeout=120)
    written = {Path(path).name for event, path in map(json.loads, writes.read_text().splitlines())
               if event == "open" and path.startswith(str(out))}
    assert {"config.json", "tokenizer.json"} <= written
