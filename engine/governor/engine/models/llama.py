"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

The batch is flattened: `input_ids` and `positions` are [T] for all scheduled tokens of all sequences;
attention reads and writes the paged cache through `AttentionMetadata`. Layers follow Hugging Face's
math exactly (fp32 RMSNorm statistics, rotate-half rotary) so fp32 outputs match transformers.

Under tensor parallelism the model is built from the rank's `shard_config` (its share of the heads and
MLP columns, tp/sharding.py) and `load_weights` reads only that rank's slice of each checkpoint tensor;
o_proj and down_proj outputs are partial sums, completed by an all-reduce over the ranks, which is fused with the
residual add and RMSNorm that follow it where the peer-to-peer memory takes the message (`CausalLM._sum_add_norm`:
decode steps). The vocabulary is split too: each rank holds ceil(V / N) rows of the embedding and of lm_head (the
last rank's tail is zero padding). A token's embedding comes from the rank that holds its row (the others add zeros,
in the same all-reduce pattern), and each rank's logits cover its rows; they are gathered for the rows that sample
only.

A pre-quantized checkpoint (AWQ, GPTQ, block-scaled fp8: `cfg.quantization`) holds each decoder linear as a
`QuantizedLinear` (models/quantization.py) in place of the dense weight, fused the same way (AWQ's codes repacked
into GPTQ's layout once loaded); on fused steps it streams its packed bytes through `fp8_gemv` or `gptq_gemv` (one
row), `packed_gemm` (a few rows of AWQ or GPTQ with groups in order), the dense weight `packed_dequantize` writes
(other AWQ or GPTQ steps) or an e4m3 GEMM (fp8, several rows); every other case runs the reference dequantize path.
Embeddings, norms and lm_head stay dense.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from governor.engine.attention import AttentionMetadata, PagedAttention
from governor.engine.models.checkpoint import LazyTensor, read_share
from governor.engine.models.model_config import ModelConfig, RopeConfig
from governor.engine.models.quantization import FP8_METHODS, PACKED_TENSORS, QuantizedLinear, RoundedInput
from governor.engine.tp.group import SINGLE, TPGroup
from governor.kernels import elementwise
from governor.kernels.argmax import argmax_rows
from governor.kernels.fp8_quant import add_rms_norm_fp8, fp8_round
from governor.kernels.gemv import gemv, gemv_usable
from governor.kernels.launch_policy import LaunchPolicy, policy_for
from governor.kernels.paged_attention import rotary_write_kv


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _weight(cfg: ModelConfig, out_parts: tuple[int, ...], in_features: int, dtype: torch.dtype,
            device: torch.device, tp: TPGroup, split: str) -> nn.Parameter | QuantizedLinear:
    """A linear's weight [sum(out_parts), in_features] (this rank's share, cut along `split`: "out" or "in"): dense,
    or packed when the checkpoint is pre-quantized."""
    if cfg.quantization is None:
        return _param(sum(out_parts), in_features, dtype=dtype, device=device)
    return QuantizedLinear(cfg.quantization, in_features, out_parts, device, split, tp.rank, tp.size)


def linear(x: torch.Tensor | RoundedInput, w: torch.Tensor | QuantizedLinear, bias: torch.Tensor | None,
           kernels: LaunchPolicy | None) -> torch.Tensor:
    """F.linear(x, w, bias); on the fused path (`kernels`: its launch policy) a one-token step streams w through
    `gemv` instead. A quantized `w` runs its own forward (`QuantizedLinear.forward`: its one-row GEMV on the fused
    path, else the reference dequantize path), which also takes an input rounded for it (`RoundedInput`)."""
    if isinstance(w, QuantizedLinear):
        return w(x, bias, kernels)
    assert isinstance(x, torch.Tensor), "only a W8A8 layer takes a rounded input"
    if kernels is not None and gemv_usable(x, w):
        return gemv(x, w, bias, policy=kernels)
    return F.linear(x, w, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise.rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None, kernels: LaunchPolicy | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): in one Triton kernel on the fused path (`kernels`)."""
        if kernels is None:
            return elementwise.add_rms_norm_ref(x, residual, self.weight, self.eps)
        return elementwise.add_rms_norm(x, residual, self.weight, self.eps, policy=kernels)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, with Llama 3's wavelength-dependent scaling or linear scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """cos and sin for every position up to max_positions, in the model dtype (HF computes them in fp32 and
    casts per use: the same values). sin has its first half negated (`elementwise.rotate_ref`)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rope, head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :head_dim // 2] *= -1
        self.table: torch.Tensor = torch.stack((emb.cos(), sin), dim=1).to(dtype).to(device)  # [P, 2, D]

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """cos and signed sin of each token [T, 2, 1, D], gathered once per forward for every layer."""
        return self.table[positions].unsqueeze(2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend: PagedAttention,
                 tp: TPGroup, rotary: Rotary) -> None:
        super().__init__()
        self.rotary = rotary
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul: rows [q | k | v].
        self.qkv_weight = _weight(cfg, (self.q_size, self.kv_size, self.kv_size), cfg.hidden_size, dtype, device,
                                  tp, "out")
        self.qkv_bias = (_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if cfg.attention_bias else None)
        self.o_weight = _weight(cfg, (cfg.hidden_size,), self.q_size, dtype, device, tp, "in")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.backend = backend
        # fp8 KV cache: static per-kv-head scales, set once by calibration before the cache is allocated.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # Calibration: when observing, the running per-head max |k| and |v| of everything computed.
        self.observe = False
        self.k_amax: torch.Tensor | None = None
        self.v_amax: torch.Tensor | None = None

    def _observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        k_amax, v_amax = k.abs().amax(dim=(0, 2)).float(), v.abs().amax(dim=(0, 2)).float()
        self.k_amax = k_amax if self.k_amax is None else torch.maximum(self.k_amax, k_amax)
        self.v_amax = v_amax if self.v_amax is None else torch.maximum(self.v_amax, v_amax)

    def forward(self, x: torch.Tensor | RoundedInput, positions: torch.Tensor, cos_sin: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """o_proj's output (under tensor parallelism this rank's partial sum). `cos_sin`: the step's `Rotary.lookup`
        rows, or None for the fused path (Triton backend), where one kernel norms (Qwen3) and rotates q and k and
        writes k and v to the cache."""
        kernels = self.backend.policy if cos_sin is None and not self.observe else None
        qkv = linear(x, self.qkv_weight, self.qkv_bias, kernels)
        if kernels is not None:
            q_norm = None if self.q_norm is None else self.q_norm.weight
            k_norm = None if self.k_norm is None else self.k_norm.weight
            eps = 0.0 if self.q_norm is None else self.q_norm.eps
            if kernels.decode_rotary and meta.num_decode_tokens == qkv.shape[0]:  # one query a sequence
                out = self.backend.attend_rotary(qkv, positions, self.rotary.table, self.num_heads, kv_cache, meta,
                                                 q_norm=q_norm, k_norm=k_norm, eps=eps, k_scale=self.k_scale,
                                                 v_scale=self.v_scale)
            else:
                q = rotary_write_kv(qkv, positions, self.rotary.table, self.num_heads, *kv_cache, meta.slot_mapping,
                                    q_norm=q_norm, k_norm=k_norm, eps=eps, k_scale=self.k_scale,
                                    v_scale=self.v_scale, policy=kernels)
                out = self.backend.attend(q, kv_cache, meta, self.k_scale, self.v_scale)
        else:
            out = self._unfused(qkv, self.rotary.lookup(positions) if cos_sin is None else cos_sin, kv_cache, meta)
        return linear(out.reshape(-1, self.q_size), self.o_weight, None, kernels)

    def _unfused(self, qkv: torch.Tensor, cos_sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The PyTorch path (CPU, and fp8 calibration, which observes k and v)."""
        t, qk_size, d = qkv.shape[0], self.q_size + self.kv_size, self.head_dim
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = elementwise.rotate_ref(self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, d)), cos_sin)
            k = elementwise.rotate_ref(self.k_norm(qkv[:, self.q_size:qk_size].view(t, self.num_kv_heads, d)),
                                       cos_sin)
        else:  # q and k sit side by side in qkv: rotate them together
            qk = elementwise.rotate_ref(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, d), cos_sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.observe:
            self._observe(k, v)
        return self.backend(q, k, v, kv_cache, meta, self.k_scale, self.v_scale)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        # gate and up projections fused: rows [gate | up].
        self.gate_up_weight = _weight(cfg, (cfg.intermediate_size,) * 2, cfg.hidden_size, dtype, device, tp, "out")
        self.down_weight = _weight(cfg, (cfg.hidden_size,), cfg.intermediate_size, dtype, device, tp, "in")

    def forward(self, x: torch.Tensor | RoundedInput, kernels: LaunchPolicy | None) -> torch.Tensor:
        """down_proj's output (under tensor parallelism this rank's partial sum)."""
        gate_up = linear(x, self.gate_up_weight, None, kernels)
        group = self.down_weight.one_row_rounding(gate_up, kernels) if isinstance(self.down_weight,
                                                                                 QuantizedLinear) else None
        if kernels is None:
            down = linear(elementwise.silu_mul_ref(gate_up), self.down_weight, None, None)
        elif isinstance(self.down_weight, torch.Tensor) and gemv_usable(gate_up, self.down_weight):
            down = gemv(gate_up, self.down_weight, silu_mul=True, policy=kernels)  # SiLU·mul folded into the GEMV
        elif group is not None:  # W8A8, one row: SiLU·mul and the input's rounding in one kernel
            down = linear(RoundedInput(fp8_round(gate_up, group, torch.float32, silu_mul=True), gate_up.dtype),
                          self.down_weight, None, kernels)
        else:
            down = linear(elementwise.silu_mul(gate_up, policy=kernels), self.down_weight, None, kernels)
        return down


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, backend: PagedAttention,
                 tp: TPGroup, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, backend, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device, tp)


# Checkpoint projection → (block, the fused weight it belongs to, its part of that weight's output features).
_PACKED_PARTS = {"q_proj": ("self_attn", "qkv_weight", 0), "k_proj": ("self_attn", "qkv_weight", 1),
                 "v_proj": ("self_attn", "qkv_weight", 2), "o_proj": ("self_attn", "o_weight", 0),
                 "gate_proj": ("mlp", "gate_up_weight", 0), "up_proj": ("mlp", "gate_up_weight", 1),
                 "down_proj": ("mlp", "down_weight", 0)}


def vocab_parallel_argmax(logits: torch.Tensor, vocab_start: int, size: int,
                          all_gather_columns: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Each row's argmax over the whole vocabulary [rows] int64, from this rank's logits of ids vocab_start.. (its
    padding columns already cut off): the local (max, id) of every rank side by side, then the first rank with the
    row's maximum, which holds the lowest id among ties (torch.argmax's choice)."""
    ids = argmax_rows(logits)
    best = torch.stack([logits.gather(1, ids.unsqueeze(1)).squeeze(1).double(),
                        (ids + vocab_start).double()], dim=1)  # exact for any bf16/fp32 value and id
    every = all_gather_columns(best).view(-1, size, 2)  # [rows, rank, (max, id)]
    rank = every[:, :, 0].argmax(dim=1, keepdim=True)
    return every[:, :, 1].gather(1, rank).squeeze(1).long()


class CausalLM(nn.Module):
    """Decoder-only transformer of the Llama family; forward over a flattened, paged batch.

    `cfg` is the rank's share of the model (`shard_config`; the whole model when `tp` is SINGLE); the rank holds
    vocabulary rows [vocab_start, vocab_start + vocab_rows) of the embedding and lm_head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 backend: PagedAttention, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # The Triton backend runs the fused elementwise kernels too (kernels.elementwise): one kernel for
        # residual add + norm, one for rotary + KV write, one for SiLU·mul, where PyTorch runs several. They and
        # the attention kernels launch with one policy, the backend's (the device's unless it was given one).
        self.kernels: LaunchPolicy | None = None
        if backend.backend == "triton":
            if backend.policy is None:
                backend.policy = policy_for(device)
            self.kernels = backend.policy
        self.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions, dtype, device)
        self.vocab_rows = -(-cfg.vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_rows
        self.embed_tokens = _param(self.vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.decoder_layers = [DecoderLayer(cfg, dtype, device, backend, tp, self.rotary)
                               for _ in range(cfg.num_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else _param(self.vocab_rows, cfg.hidden_size, dtype=dtype, device=device))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's embedding row; under tensor parallelism this rank's part of it, the row where the rank holds
        it and zeros elsewhere (no host sync: the step stays capturable), which the first norm sums over the ranks."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_rows)
        return F.embedding(local.clamp(0, self.vocab_rows - 1), self.embed_tokens) * held.unsqueeze(1).to(
            self.embed_tokens.dtype)

    def _sum_add_norm(self, norm: RMSNorm, partial: torch.Tensor, residual: torch.Tensor | None,
                      kernels: LaunchPolicy | None, consumer: torch.Tensor | QuantizedLinear | None = None
                      ) -> tuple[torch.Tensor | RoundedInput, torch.Tensor]:
        """`norm.add_forward` of the ranks' sum of `partial` (a row-parallel matmul's output or the embedding): the
        all-reduce, residual add and norm in one kernel where the peer-to-peer memory takes the message (a decode
        step's), else the all-reduce then the norm. With one rank the sum is `partial` itself. When the layer the
        norm feeds (`consumer`) is a one-row W8A8 step, the norm kernel writes its input rounded for it."""
        if kernels is not None and self.tp.p2p is not None:
            fused = self.tp.p2p.add_rms_norm(partial, residual, norm.weight, norm.eps, kernels)
            if fused is not None:
                return fused
        summed = self.tp.all_reduce(partial)
        group = consumer.one_row_rounding(summed, kernels) if isinstance(consumer, QuantizedLinear) else None
        if group is not None:
            rounded, summed_residual = add_rms_norm_fp8(summed, residual, norm.weight, norm.eps, group, policy=kernels)
            return RoundedInput(rounded, summed.dtype), summed_residual
        return norm.add_forward(summed, residual, kernels)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        kernels = self.kernels
        h = self.embed(input_ids)
        cos_sin = None if kernels is not None else self.rotary.lookup(positions)  # gathered once for every layer
        residual: torch.Tensor | None = None  # the residual stream; h is the last block's output (a partial sum
        # under tensor parallelism)
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            x, residual = self._sum_add_norm(layer.input_layernorm, h, residual, kernels, layer.self_attn.qkv_weight)
            h = layer.self_attn(x, positions, cos_sin, kv_cache, meta)
            x, residual = self._sum_add_norm(layer.post_attention_layernorm, h, residual, kernels,
                                             layer.mlp.gate_up_weight)
            h = layer.mlp(x, kernels)
        hidden = self._sum_add_norm(self.norm, h, residual, kernels)[0]
        assert isinstance(hidden, torch.Tensor)  # the final norm feeds lm_head, never a W8A8 layer
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of each row of `hidden` [rows, vocab]. Under tensor parallelism every rank calls it with the
        same rows: each computes its vocabulary rows' logits (in the model's dtype) and all gather them. A caller
        that needs only the argmax takes `compute_argmax`, which saves the [rows, vocab] fp32 copy a step."""
        logits = linear(hidden, self.lm_head, None, self.kernels)
        if self.tp.size > 1:
            logits = self.tp.all_gather_columns(logits)[:, :self.cfg.vocab_size]
        return logits.float()

    @torch.inference_mode()
    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token id of each row's logits [rows] int64 (the lowest id among ties), without the logits
        leaving the device. Under tensor parallelism each rank takes the argmax of its vocabulary rows (the
        padding rows past the vocabulary left out) and all gather only (max, id) per row: a step of greedy
        tokens moves rows × 2 values between the ranks instead of rows × vocab."""
        logits = linear(hidden, self.lm_head, None, self.kernels)
        if self.tp.size == 1:
            return argmax_rows(logits, self.kernels)
        held = min(self.vocab_rows, self.cfg.vocab_size - self.vocab_start)
        return vocab_parallel_argmax(logits[:, :held], self.vocab_start, self.tp.size, self.tp.all_gather_columns)

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, LazyTensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be filled.

        A split tensor (column-parallel: dim 0, row-parallel: dim 1) is read only in this rank's slice:
        block `tp.rank` of `tp.size` equal blocks."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
                      "gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
        packed = {name: m for name, m in self.named_modules() if isinstance(m, QuantizedLinear)}
        pending: dict[str, int] = {}  # parameter name → rows still to fill (fused) or 1
        for name, param in self.named_parameters(remove_duplicate=True):
            if name.rpartition(".")[0] in packed:
                continue  # a QuantizedLinear tracks its own tensors
            pending[name] = param.shape[0] if name.endswith(("qkv_weight", "qkv_bias", "gate_up_weight")) else 1
        layer_re = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)"
                              r"(?:\.(\w+))?\.(weight|bias|qweight|qzeros|scales|g_idx|weight_scale_inv|weight_scale)$")
        for hf_name, tensor in weights:
            m = layer_re.match(hf_name)
            if m is not None and (m.group(4) in (*PACKED_TENSORS, "weight_scale_inv", "weight_scale")
                                  or (packed and m.group(4) == "weight" and m.group(3) in _PACKED_PARTS)):
                self._load_packed(hf_name, m, tensor)
                continue
            target, rows, split_dim = self._target(hf_name, layer_re, fused_rows)
            if target is None:
                if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint for {cfg.architecture}")
            param = self.get_parameter(target)
            if target in ("embed_tokens", "lm_head"):
                self._load_vocab_rows(hf_name, tensor, param.data)
                pending[target] -= 1
                continue
            dest = param.data if rows is None else param.data[rows[0]:rows[1]]
            dest.copy_(self._read_shard(hf_name, tensor, tuple(dest.shape), split_dim))
            pending[target] -= dest.shape[0] if rows is not None else 1
        missing = [n for n, left in pending.items() if left > 0]
        missing += [f"{name} {what}" for name, module in packed.items() for what in module.missing()]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
        for module in packed.values():
            if module.repack() and module.qweight.is_cuda:
                # The repack's temporaries (hundreds of MB a slice) go back to the driver before the next module's
                # tensors are allocated, which would otherwise be carved out of their cached segments and pin them:
                # what stays cached then is lost to the KV cache, sized from the driver's free memory.
                torch.cuda.empty_cache()

    def _load_packed(self, hf_name: str, m: re.Match[str], tensor: LazyTensor) -> None:
        """One packed tensor (qweight, qzeros, scales, g_idx; fp8: weight, weight_scale_inv) of a quantized linear, into
        its part's columns (fp8: rows)."""
        quant = self.cfg.quantization
        if quant is None:
            raise ValueError(f"unexpected tensor {hf_name!r}: a quantized weight, but config.json has no "
                             "quantization_config")
        if m.group(4) == "weight" and quant.method not in FP8_METHODS:
            raise ValueError(f"tensor {hf_name!r} is a dense weight, but config.json's quantization_config says "
                             f"{quant.method}: every decoder linear must be stored quantized")
        block, sub = m.group(2), m.group(3)
        if sub not in _PACKED_PARTS or _PACKED_PARTS[sub][0] != block:
            raise ValueError(f"unexpected tensor {hf_name!r} in {quant.method} checkpoint for {self.cfg.architecture}")
        attr, part = _PACKED_PARTS[sub][1:]
        module = self.get_submodule(f"layers.{m.group(1)}.{block}.{attr}")
        assert isinstance(module, QuantizedLinear)
        module.load(part, m.group(4), module.read(m.group(4), tensor, hf_name), hf_name)

    def _load_vocab_rows(self, hf_name: str, tensor: LazyTensor, dest: torch.Tensor) -> None:
        """This rank's vocabulary rows of an embedding-shaped tensor [V, hidden]; rows past V are zeros."""
        full = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(tensor.get_shape()) != full:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.get_shape())}, expected {full} from "
                             "config.json")
        start = self.vocab_start
        end = min(start + self.vocab_rows, self.cfg.vocab_size)
        if self.tp.size == 1:
            dest.copy_(tensor[:])
            return
        dest[:end - start].copy_(tensor[start:end])
        dest[end - start:].zero_()

    def _read_shard(self, hf_name: str, tensor: LazyTensor, dest_shape: tuple[int, ...],
                    split_dim: int | None) -> torch.Tensor:
        """Read this rank's part of `tensor` (all of it when it is replicated or there is one rank)."""
        full = list(dest_shape)
        if split_dim is not None:
            full[split_dim] *= self.tp.size
        if list(tensor.get_shape()) != full:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.get_shape())}, "
                             f"expected {tuple(full)} from config.json")
        if split_dim is None or self.tp.size == 1:
            return tensor[:]
        return read_share(tensor, split_dim, self.tp.rank, self.tp.size)

    def _target(self, hf_name: str, layer_re: re.Pattern[str], fused_rows: dict[str, tuple[int, int]]
                ) -> tuple[str | None, tuple[int, int] | None, int | None]:
        """(parameter, its rows this tensor fills or None for all, the dim the tensor is split along
        across ranks or None when replicated)."""
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens", None, 0
        if hf_name == "model.norm.weight":
            return "norm.weight", None, None
        if hf_name == "lm_head.weight":
            return (None, None, None) if self.cfg.tie_word_embeddings else ("lm_head", None, 0)
        m = layer_re.match(hf_name)
        if m is None:
            return None, None, None
        i, block, sub, kind = m.group(1), m.group(2), m.group(3), m.group(4)
        prefix = f"layers.{i}."
        if block in ("input_layernorm", "post_attention_layernorm"):
            return prefix + f"{block}.weight", None, None
        if block == "self_attn":
            if sub in ("q_proj", "k_proj", "v_proj"):
                return prefix + f"self_attn.qkv_{kind}", fused_rows[sub], 0
            if sub == "o_proj" and kind == "weight":
                return prefix + "self_attn.o_weight", None, 1
            if sub in ("q_norm", "k_norm") and self.cfg.qk_norm:
                return prefix + f"self_attn.{sub}.weight", None, None
        if block == "mlp":
            if sub in ("gate_proj", "up_proj") and kind == "weight":
                return prefix + "mlp.gate_up_weight", fused_rows[sub], 0
            if sub == "down_proj" and kind == "weight":
                return prefix + "mlp.down_weight", None, 1
        return None, None, None
