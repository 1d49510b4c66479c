"""A small Llama trained for about a minute on CPU, for accuracy tests that random weights cannot answer.

Random weights give flat logits (or, scaled up, near one-hot ones), so "does fp8 change the model's choices" has no
meaning on them. This model is trained on text that ships with Python (the standard library's sources) with the
project's own tokenizer: after `STEPS` steps its next-token distributions are peaked where code is predictable and
spread where it is not, as a trained model's are. Training is seeded and runs single-process in fp32, so a session
builds the same model each time (pytest caches it per session: tests/conftest.py `trained_llama`).

`held_out_prompts` draws prompts from standard-library files the model never saw.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from governor.engine.models.tokenizer_builder import BOS_ID, EOS_ID, build_tokenizer, write_tokenizer

STEPS = 150
SEQ_LEN = 128
BATCH = 16
# ~4.2 M parameters: hidden 256, 4 layers, 4 heads of 64 (2 KV heads), MLP 768, vocabulary 2,048 (the tokenizer's
# 2,000 padded). Every dimension is a multiple of 128, so fp8 block-scaled layouts fit it too.
CONFIG = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0,
          "tie_word_embeddings": False}


def _sources() -> list[Path]:
    """The standard library's top-level .py files, sorted: the same list on every machine with this Python."""
    lib = Path(os.__file__).parent
    files = sorted(lib.glob("*.py"))
    if len(files) < 100:
        raise RuntimeError(f"the trained test model needs the standard library's .py sources; {lib} has "
                           f"{len(files)} (a Python installed without its sources)")
    return files


def _text(files: list[Path], limit: int) -> str:
    parts, size = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "\n".join(parts)[:limit]


def train_llama(out_dir: Path, steps: int = STEPS, seed: int = 0) -> Path:
    """Train the model on the first ~1.5 MB of standard-library sources (every other file; the rest are held out)
    and save it with its tokenizer as a Hugging Face checkpoint in `out_dir`."""
    import transformers

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    ids = torch.tensor(tokenizer.encode(_text(_sources()[::2], 1_500_000)).ids, dtype=torch.long)
    config = transformers.LlamaConfig(**CONFIG, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    t0, losses = time.monotonic(), []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir, model_max_length=CONFIG["max_position_embeddings"])
    (out_dir / "training.txt").write_text(f"steps {steps}, {time.monotonic() - t0:.0f} s, loss {losses[0]:.2f} -> "
                                          f"{sum(losses[-10:]) / 10:.2f}\n")
    return out_dir


def held_out_prompts(n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` token ids from standard-library files the model was not trained on."""
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(_text(_sources()[1::2], 200_000)).ids
    stride = (len(ids) - length) // n
    return [ids[i * stride:i * stride + length] for i in range(n)]
