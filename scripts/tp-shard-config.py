"""A config-only model directory of one rank's share of a model under N-way tensor parallelism, as a dense model.

    python3 scripts/tp-shard-config.py SRC_DIR DST_DIR N

DST_DIR gets SRC_DIR's config.json with 1/N of the query heads, KV heads, MLP columns and vocabulary rows (rounded
up), and its tokenizer files. Decoding it on one GPU (`--load-format dummy`) runs the kernels a rank of an N-way
engine runs, on the same shapes, without the all-reduces, the vocabulary gather or the other ranks: a TP step's
time less this one's is what spreading the model over N GPUs costs beyond the arithmetic.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    src, dst, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    cfg = json.loads((src / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if cfg[key] % n:
            raise SystemExit(f"{key}={cfg[key]} does not split {n} ways")
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg["num_attention_heads"] //= n
    cfg["num_key_value_heads"] //= n
    cfg["intermediate_size"] //= n
    cfg["vocab_size"] = -(-cfg["vocab_size"] // n)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name != "config.json" and f.suffix in (".json", ".model", ".txt") and "safetensors" not in f.name:
            shutil.copy(f, dst / f.name)
    print(f"wrote one rank's share of {src} at TP {n} to {dst}")


if __name__ == "__main__":
    main()
