"""What every peer runner shares: importing the peer with an error that says how to get it, the engine's view of a
checkpoint's vocabulary, and writing a result in the envelope of the engine's own benchmarks
(`governor.engine.bench.cache.write_envelope`), so that one summary reads the engine's and the peers' JSON alike."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from governor.engine.bench.cache import write_envelope


class PeerMissing(SystemExit):
    """The peer cannot be imported; exits the runner with a message that says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def import_peer(module: str, hint: str) -> ModuleType:
    """`module`, or PeerMissing with `hint` and the import error."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise PeerMissing(f"{hint} ({type(e).__name__}: {e})") from e


def engine_vocab(model: str) -> int:
    """The ids the engine's benchmarks draw random prompts from: min(config vocab_size, tokenizer length), as
    `governor bench throughput` and `bench latency` compute it."""
    from governor.engine.models.model_config import load_model_config
    from governor.engine.tokenizer import load_tokenizer

    return min(load_model_config(model).vocab_size, len(load_tokenizer(model)))


def write_result(kind: str, model: str, result: dict[str, Any], output_json: str | None,
                 workload: dict[str, Any] | None = None) -> dict[str, Any]:
    """The envelope of `governor bench KIND` around `result` (plus the throughput envelope's workload), written to
    `output_json` when given."""
    envelope = write_envelope(kind, model, result, None)
    if workload is not None:
        head = {k: envelope[k] for k in ("benchmark", "time", "hardware")}
        envelope = {**head, "workload": workload, "model": envelope["model"], "result": result}
    if output_json:
        Path(output_json).write_text(json.dumps(envelope, indent=2, default=str) + "\n")
    return envelope
