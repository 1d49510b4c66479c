"""Next-token bitmasks: one int32 row of ceil(vocab / 32) words per sequence, bit set = token allowed.

Token t lives in word t // 32, bit t % 32 (least significant first). Torch only, so the engine masks logits without
the grammar library, on any device and in any float dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Byte k of a little-endian int32 word holds bits 8k..8k+7, so a bitmask read as bytes keeps token order, and one
# lookup per byte value unpacks 8 tokens: as 8 additive penalties (0 where the bit is set, -inf where it is not), or
# as one int64 whose 8 bytes are the 8 tokens' "masked" flags (read back as bools).
_BYTE_BITS = (torch.arange(256, dtype=torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1
_PENALTY_TABLE = torch.where(_BYTE_BITS == 1, 0.0, float("-inf"))
_MASKED_TABLE = ((_BYTE_BITS == 0).to(torch.int64) << (8 * torch.arange(8))).sum(-1)
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def bitmask_row(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The int32 bitmask row [ceil(vocab_size / 32)] that allows `tokens` and nothing else."""
    bits = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.int64)
    bits[list(tokens)] = 1
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    # Bit 31 is an int32's sign: wrap the unsigned word into int32's range explicitly.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [rows, ceil(vocab_size / 32)] with every token allowed (a row nobody fills masks nothing).

    Pinned when CUDA is present, so its copy to the logits' GPU does not stall the host."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits[i, t]` to -inf in place wherever bit t of `bitmask[i]` is 0; other logits keep their values.

    logits: [rows, vocab] fp32/bf16/fp16 on CPU or CUDA. bitmask: int32 [rows, ceil(vocab / 32)] (further words are
    ignored), on any device: it is copied to the logits' device when it is elsewhere."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits [rows, vocab] and bitmask [rows, words] must have the same rows, got logits "
                         f"{tuple(logits.shape)} and bitmask {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    rows, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, fewer than "
                         f"the logits' {vocab}: allocate it with allocate_bitmask(rows, {vocab})")
    as_bytes = bitmask.to(logits.device, non_blocking=True).contiguous().view(torch.uint8).reshape(-1).int()
    # Measured on [64, 128k] (docs/design/structured-outputs.md): on CPU a bool mask makes masked_fill_ slow and
    # adding gathered penalties is several times faster; on an H100 gathering 8-float rows is slow (660 us) and one
    # int64 per byte, then masked_fill_, takes about 70 us. On CPU a masked +inf or NaN logit becomes NaN.
    if logits.device.type == "cpu":
        penalty = torch.index_select(_table(_PENALTY_TABLE, logits.device, logits.dtype), 0, as_bytes)
        logits.add_(penalty.view(rows, -1)[:, :vocab])
    else:
        masked = torch.index_select(_table(_MASKED_TABLE, logits.device, torch.int64), 0, as_bytes)
        logits.masked_fill_(masked.view(torch.bool).view(rows, -1)[:, :vocab], float("-inf"))


def _table(table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    if key not in _TABLES:  # a few bytes per (device, dtype), copied once rather than every step
        _TABLES[key] = table.to(device=device, dtype=dtype)
    return _TABLES[key]
