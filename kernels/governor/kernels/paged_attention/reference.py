"""The plain-PyTorch paged attention, `paged_attention_ref`: the oracle for the decode and prefill kernels.

It computes causal attention of varlen queries over the paged cache in float32 (an fp8 cache dequantized first),
one sequence at a time. Tests hold both kernels to it, and the engine runs it as the CPU path for tiny models.
"""

from __future__ import annotations

import torch

from .checks import _check_attention_args


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of varlen queries over a paged KV cache, in float32; the oracle.

    q: [T, num_q_heads, head_dim]; returns [T, num_q_heads, head_dim] in q.dtype. Loops over
    sequences (one host sync for the lengths) and is vectorized within each. An fp8 cache needs
    `k_scale`/`v_scale` [num_kv_heads]: K/V are dequantized to float32, then the same math.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{seq_lens.shape[0] + 1}], got {tuple(query_start_loc.shape)}"
        )
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_begin
        if q_len == 0 or seq_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {i}: {q_len} queries but only {seq_len} tokens of context")
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = _read_context(k_cache, blocks, seq_len, k_scale)
        v = _read_context(v_cache, blocks, seq_len, v_scale)
        # [q_len, Hq, D] -> [kv heads, group * q_len, D]: a group's heads share one K/V.
        qi = q[q_begin:q_end].float().reshape(q_len, num_kv_heads, group, head_dim)
        qi = qi.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        scores = torch.bmm(qi, k.transpose(1, 2)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).repeat(group)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        o = torch.bmm(scores.softmax(dim=-1), v)  # [kv heads, group * q_len, D]
        o = o.reshape(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_begin:q_end] = o.reshape(q_len, num_q_heads, head_dim).to(q.dtype)
    return out


def _read_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scale: torch.Tensor | None) -> torch.Tensor:
    """One sequence's first `seq_len` cached K or V as float32 [kv heads, seq_len, D], dequantized."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    x = cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    if scale is not None:
        x = x * scale[:, None]
    return x.transpose(0, 1)

