"""Pre-quantized linear weights (AWQ, GPTQ, block-scaled fp8): the packed tensors of one linear layer, their
unpacking, and the reference matmul that dequantizes them.

Both formats store, per linear of `in` input and `out` output features and `G = in / group_size` groups,
integer codes q, a zero point z and a scale s per (group, output feature); the weight is
W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]. The tensors are kept exactly as the checkpoint stores them
(so a kernel can take either layout as it is), except that scales are held in float16:

  AWQ (GEMM version, 4 bits):  qweight [in, out/8]  int32, 8 codes per int32 along the output features in
                               AWQ's interleaved order (AWQ_ORDER); qzeros [G, out/8] int32, same packing;
                               scales [G, out]; g(i) = i // group_size.
  GPTQ (checkpoint format v1): qweight [in/p, out] int32, p = 32/bits codes per int32 along the input
                               features, lowest bits first; qzeros [G, out/p] int32, packed the same way
                               along the output features and stored one less than the zero point
                               (z = stored + 1); scales [G, out]; g(i) = g_idx[i] (act-order checkpoints
                               permute which features share a group).

Block-scaled fp8 (Qwen3-FP8, DeepSeek) stores the weight itself in e4m3 and a float32 scale per block of
(bn, bk) = `weight_block_size` entries: weight [out, in] float8_e4m3fn, weight_scale_inv [ceil(out/bn),
ceil(in/bk)] float32, and W[o, i] = weight[o, i] * weight_scale_inv[o // bn, i // bk] (the last input block may be
ragged). Fused projections stack their rows (every part's output count is a multiple of bn: the config checks it).

compressed-tensors' float-quantized checkpoints store the same e4m3 weight with a `weight_scale` (any float dtype):
[out, 1] per output feature ('channel'), one value per projection ('tensor': q, k and v each have theirs, held
here as that value on each of the projection's rows), or per block like fp8's ('block').

Every AWQ and GPTQ tensor has the output features along its last dimension, so fused projections (q|k|v, gate|up)
are the parts' tensors concatenated along it: columns of qweight and qzeros by whole packed int32s (every part's
output count is a multiple of the packing), g_idx shared (the parts read the same input, so the quantizer gave
them the same one; the loader checks it).

Under tensor parallelism a rank holds its share of each layer, cut from the checkpoint's tensors as they are stored
(`QuantizedLinear.read`): a column-parallel layer (q, k, v, gate, up) its output features, a row-parallel one (o,
down) its input features, each tensor along the dimension that holds them (packed columns by whole int32s, fp8 scale
rows and columns by whole blocks, AWQ/GPTQ groups by whole groups). What every rank needs whole is read whole: the
per-output-feature and per-tensor scales of a row-parallel layer, and a GPTQ act-order layer's zeros and scales,
whose groups are scattered over the input features (g_idx is cut, its group ids kept). Online fp8 quantizes each
output feature over its whole row, then keeps the rank's columns, so every TP size holds the same codes and scales.
A shard that would split a pack, a group or a block is refused at build time, naming the sizes.

fp8 runs W8A8 where the checkpoint quantizes activations (`WeightQuantization.activation_group` is not None:
fp8's dynamic activation scheme, compressed-tensors' dynamic per-token input activations, and fp8 quantized at
load): on every path, a layer's input is quantized to e4m3 with a dynamic scale per token, or per group of the
weight's input block (block-scaled fp8), before it meets the weight (kernels/fp8_quant.py). A step of several rows
multiplies the codes directly: on the fused path in `fp8_block_gemm` (kernels/fp8_gemm.py: e4m3 dots scaled per
K block) for block-scaled weights, and for one scale per token and per output feature (fp8 quantized at load,
compressed-tensors per channel or per tensor) in a step its split launch takes (a decode batch); other steps of
several rows of those in `torch._scaled_mm` (e4m3 GEMM on sm_89+ GPUs, exact products on a CPU); elsewhere the
input becomes the values its codes stand for, in float32 (`fp8_round`), times the exact weight (`fp8_gemv`, or
the reference matmul in float32). Every path thus sums exact products in float32 and rounds once, so a token's
result depends on its step's path only through the order of a sum. Under tensor parallelism a row-parallel layer's
token scale is that of the rank's share of the token (each rank quantizes what it holds, with no
collective), as in vLLM.
fp8 checkpoints without an activation scheme run weight-only.

Once loaded, AWQ's codes are repacked along the input features as GPTQ's (`QuantizedLinear.repack`), so AWQ and GPTQ
share their kernels. `QuantizedLinear.forward` takes a one-row step on the fused path through the one-row GEMVs
(`fp8_gemv`, `gptq_gemv`), a step of up to PACKED_GEMM_MAX_ROWS rows of an AWQ or GPTQ layer whose groups are in
order through `packed_gemm` (the codes multiplied where they lie, every row at once), any other step of several rows
of one through `packed_dequantize` and a dense matmul (the whole weight written in the activation dtype by one
kernel, then cuBLAS), and anything else
through the reference path: the whole weight dequantized by PyTorch ops on every call and a dense matmul, correct on
any device and slow on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from governor.engine.models.checkpoint import LazyTensor, read_share
from governor.engine.models.make_model import INIT_STD, tensor_generator
from governor.engine.models.model_config import UnsupportedModelError, WeightQuantization
from governor.kernels.elementwise import triton_usable
from governor.kernels.fp8_gemm import fp8_block_gemm, fp8_block_gemm_usable, fp8_gemm_splits_k
from governor.kernels.fp8_quant import (
    E4M3_MAX,
    FP8_DTYPE,
    fp8_quantize,
    fp8_quantize_ref,
    fp8_round,
    fp8_round_ref,
    norm_rounding_supported,
)
from governor.kernels.gemv import fp8_gemv, fp8_gemv_usable
from governor.kernels.launch_policy import LaunchPolicy
from governor.kernels.packed_gemm import packed_dequantize, packed_dequantize_usable, packed_gemm, packed_gemm_usable
from governor.kernels.packed_gemv import awq_gemv, gptq_gemv, packed_gemv_usable

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k (from the lowest bits) of an AWQ int32 holds column AWQ_ORDER[k]
PACKED_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # AWQ and GPTQ
FP8_TENSORS = ("weight", "weight_scale_inv")  # block-scaled fp8
CT_TENSORS = ("weight", "weight_scale")  # compressed-tensors float-quantized: the same e4m3 codes times the scale
FP8_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class RoundedInput:
    """A one-row W8A8 layer's input as `fp8_round` rounds it (float32 values, [1, K]), written so by the kernel
    before the layer (the add + RMSNorm, `fp8_quant.add_rms_norm_fp8`, or SiLU·mul, `fp8_round(..., silu_mul=True)`),
    and the dtype the layer's output takes (the model's): the layer multiplies it as it is, with no rounding kernel
    of its own (`QuantizedLinear.one_row_rounding`)."""

    values: torch.Tensor
    dtype: torch.dtype


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every int32 of `packed` into its 32/bits unsigned codes, lowest bits first, laid out consecutively
    along `dim` (which grows 32/bits times)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    dim = dim % packed.dim()
    x = packed.unsqueeze(dim + 1)
    codes = (x >> shifts.view([per if d == dim + 1 else 1 for d in range(x.dim())])) & ((1 << bits) - 1)
    return codes.flatten(dim, dim + 1)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def scaled_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` multiplies e4m3 x [M, K] by w [N, K] with a scale per row of each: on a CPU any
    shape; on CUDA its row-wise kernels, which write bfloat16 on sm_89+ and take K and N in multiples of 16."""
    if x.device.type == "cpu":
        return True
    return (x.is_cuda and x.dtype == torch.bfloat16 and _capability(x.device) >= (8, 9)
            and x.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


def dummy_linear_tensors(quant: WeightQuantization, device: str | torch.device, seed: int, prefix: str,
                         out_features: int, in_features: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors of one linear (`prefix`: its name less ".weight") as a `quant` checkpoint stores them: what load
    format "dummy" reads for a pre-quantized config.json, so its kernels can be measured without the checkpoint.
    Codes are uniform random bits (fp8: N(0, 64) in e4m3), scales constant, chosen so the dequantized weights spread
    about as `make-model`'s dense ones do (0.02); GPTQ's g_idx keeps the features in order. Drawn from (seed, prefix)
    as `make-model` draws a tensor: every tensor-parallel size sees the same full tensors."""
    gen = tensor_generator(prefix, device, seed)
    if quant.method in FP8_METHODS:
        normal = torch.randn(out_features, in_features, generator=gen, device=device).mul_(64.0)
        yield f"{prefix}.weight", normal.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
        blocks = quant.block_size
        shape = ((-(-out_features // blocks[0]), -(-in_features // blocks[1])) if blocks is not None
                 else (1,) if quant.per_tensor else (out_features, 1))
        name = "weight_scale_inv" if quant.method == "fp8" else "weight_scale"
        yield f"{prefix}.{name}", torch.full(shape, INIT_STD / 64.0, dtype=torch.float32, device=device)
        return
    pack = 32 // quant.bits
    groups = 1 if quant.group_size == -1 else in_features // quant.group_size

    def random_bits(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32, device=device)

    # (q - z) of two uniform b-bit codes spreads 2^b / sqrt(6).
    scales = torch.full((groups, out_features), INIT_STD * 6**0.5 / 2**quant.bits, dtype=torch.float16,
                        device=device)
    if quant.method == "awq":
        yield f"{prefix}.qweight", random_bits(in_features, out_features // pack)
    else:
        yield f"{prefix}.qweight", random_bits(in_features // pack, out_features)
    yield f"{prefix}.qzeros", random_bits(groups, out_features // pack)
    yield f"{prefix}.scales", scales
    if quant.method == "gptq":
        group = in_features if quant.group_size == -1 else quant.group_size
        yield f"{prefix}.g_idx", torch.arange(in_features, dtype=torch.int32, device=device) // group


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`unpack_int32` inverted: every 32/bits consecutive codes along `dim` (which shrinks 32/bits times) into one
    int32, lowest bits first."""
    per = 32 // bits
    dim = dim % codes.dim()
    grouped = codes.to(torch.int64).unflatten(dim, (codes.shape[dim] // per, per))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (grouped << shifts.view([per if d == dim + 1 else 1 for d in range(grouped.dim())])).sum(dim + 1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32s [rows, cols/8] → 4-bit codes [rows, cols] in column order."""
    nibbles = unpack_int32(packed, 4, dim=-1).view(*packed.shape, 2, 4)
    # AWQ_ORDER puts even columns in nibbles 0-3 and odd ones in 4-7: interleaving the halves restores the order
    # (by reshaping: an index tensor built from a list per call would be a host copy a CUDA graph cannot capture).
    return nibbles.transpose(-1, -2).flatten(-3)


_REPACK_ROWS = 1024  # input rows of AWQ codes repacked at a time (a multiple of 8)


class QuantizedLinear(nn.Module):
    """The packed weight of one linear layer, or of several fused along the output features (`out_parts`:
    each part's output count, e.g. (q, kv, kv)). Parts are loaded one checkpoint tensor at a time
    (`load`); `missing()` names what no tensor has filled yet.

    Invariant: once `missing()` is empty, every tensor holds the checkpoint's values for every part."""

    def __init__(self, quant: WeightQuantization, in_features: int, out_parts: tuple[int, ...],
                 device: torch.device, split: str | None = None, rank: int = 0, size: int = 1) -> None:
        """`in_features` and `out_parts` are this rank's; under tensor parallelism (`size` > 1) `split` says which
        of them the rank holds 1/size of: "out" (column-parallel) or "in" (row-parallel)."""
        super().__init__()
        self.method, self.bits = quant.method, quant.bits
        self.in_features, self.out_parts = in_features, out_parts
        self.out_features = out = sum(out_parts)
        self.split, self.rank, self.size = (split, rank, size) if size > 1 else (None, 0, 1)
        # A layer cut along its inputs keeps every group when its groups are not contiguous runs of them: act-order
        # (features scattered over the groups) or one group over all inputs (group_size -1).
        self.replicated_groups = self.split == "in" and quant.method in ("awq", "gptq") and (
            (quant.method == "gptq" and quant.desc_act) or quant.group_size == -1)
        self._loaded: set[tuple[int, str]] = set()
        self._check_shard(quant)
        if quant.method in FP8_METHODS:
            self.online, self.per_tensor = quant.online, quant.per_tensor
            # W8A8: the checkpoint's activation scaling (None: weight-only). `quantize_activations` is what the
            # layer does, W8A8 exactly when the checkpoint says so (the accuracy tests turn it off to compare).
            self.activation_group = quant.activation_group
            self.quantize_activations = quant.activation_group is not None
            self.tensor_names = CT_TENSORS if quant.method == "compressed-tensors" else FP8_TENSORS
            # Per output feature (online fp8) when there are no blocks: blocks of one row spanning every input.
            self.block_size = bn, bk = quant.block_size or (1, in_features)
            self.blocked = quant.block_size is not None
            self.weight = nn.Parameter(torch.zeros(out, in_features, dtype=FP8_DTYPE, device=device),
                                       requires_grad=False)
            self.weight_scale_inv = nn.Parameter(torch.zeros(-(-out // bn), -(-in_features // bk),
                                                             dtype=torch.float32, device=device), requires_grad=False)
            return
        full_in = in_features * (self.size if self.split == "in" else 1)
        if self.method == "awq" and in_features % 8:
            raise UnsupportedModelError(f"an AWQ linear of {in_features} input features: its codes are repacked eight "
                                        "input features to an int32 at load, so they must be a multiple of 8")
        self.group_size = full_in if quant.group_size == -1 else quant.group_size
        groups = in_features * (self.size if self.replicated_groups else 1) // self.group_size
        self.pack = 32 // quant.bits
        p = self.pack
        qweight_shape = (in_features, out // p) if self.method == "awq" else (in_features // p, out)

        def tensor(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        self.qweight = tensor(*qweight_shape, dtype=torch.int32)
        self.qzeros = tensor(groups, out // p, dtype=torch.int32)
        self.scales = tensor(groups, out, dtype=torch.float16)
        # Group of each input feature: GPTQ reads it from the checkpoint (act-order permutes it), AWQ has none.
        self.g_idx = tensor(in_features, dtype=torch.int32)
        self.g_idx.data.copy_(torch.arange(in_features, device=device) // self.group_size)
        self._g_idx_required = quant.method == "gptq" and quant.desc_act
        # Groups of group_size consecutive features, numbered from 0 on this rank (checked when g_idx loads): the
        # GEMV then applies a group's zero points and scales once per step (kernels/packed_gemv.py).
        self.groups_in_order = not self.replicated_groups
        # Whether the codes are packed along the input features (GPTQ's layout; AWQ's after `repack`).
        self.codes_along_k = self.method == "gptq"

    def _check_shard(self, quant: WeightQuantization) -> None:
        """UnsupportedModelError when this rank's share would split a pack of codes, a group or an fp8 block."""
        if self.split is None:
            return
        if quant.method in FP8_METHODS:
            bn, bk = quant.block_size or (1, 0)
            units = [("output features of a part", min(self.out_parts), bn, "an fp8 weight block's rows")]
            if self.split == "in" and bk:
                units.append(("input features", self.in_features, bk, "an fp8 weight block's columns"))
        else:
            pack = 32 // quant.bits
            units = [("output features of a part", min(self.out_parts), pack, f"the {quant.bits}-bit packing")]
            if self.split == "in":  # GPTQ packs codes along the input features, and AWQ's are repacked so
                units.append(("input features", self.in_features, pack, f"the {quant.bits}-bit packing"))
            if self.split == "in" and not self.replicated_groups:  # the rank's groups are a contiguous run
                units.append(("input features", self.in_features, quant.group_size, "group_size"))
        for what, count, unit, name in units:
            if count % unit:
                raise UnsupportedModelError(
                    f"tensor_parallel_size={self.size} gives each rank {count} {what} of a {quant.method} layer, not "
                    f"a multiple of {name} ({unit}); a rank must hold whole packs, groups and blocks: choose a size "
                    "that keeps them whole")

    def _split_dim(self, name: str) -> int | None:
        """The dimension along which tensor `name` is cut among the ranks; None: every rank reads all of it."""
        if self.split is None:
            return None
        out = self.split == "out"
        if self.method in FP8_METHODS:
            if self.online:
                return 0 if out else None  # a row-parallel layer's rows are quantized whole, then cut (_quantize_rows)
            if name == "weight":
                return 0 if out else 1
            if self.per_tensor:
                return None
            return 0 if out else (1 if self.blocked else None)  # per-output-feature scales: every rank needs all
        if name == "g_idx":
            return None if out else 0
        if name == "qweight":
            return 1 if out else 0
        if not out and self.replicated_groups:
            return None
        return 1 if out else 0

    def read(self, name: str, tensor: LazyTensor, source: str) -> torch.Tensor:
        """This rank's share of checkpoint tensor `name` (all of it with one rank, or where every rank needs it)."""
        dim = self._split_dim(name)
        shape = tensor.get_shape()
        if dim is None:
            return tensor[:]
        if dim >= len(shape) or shape[dim] % self.size:
            raise ValueError(f"tensor {source!r} has shape {tuple(shape)}: its dimension {dim} does not split into "
                             f"tensor_parallel_size={self.size} equal shares")
        return read_share(tensor, dim, self.rank, self.size)

    def _load_fp8(self, part: int, name: str, tensor: torch.Tensor, source: str) -> None:
        """One part's rows of `weight` (e4m3) or of its scale (`weight_scale_inv`, float32; compressed-tensors'
        `weight_scale`, any float dtype); online, the part's dense weight, quantized here."""
        if self.online:
            self._quantize_rows(part, tensor, source)
            return
        if name not in self.tensor_names:
            raise ValueError(f"unexpected tensor {source!r}: {self.method} checkpoints hold "
                             f"{' and '.join(self.tensor_names)}")
        start, width = sum(self.out_parts[:part]), self.out_parts[part]
        if name == "weight" and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"tensor {source!r} is {tensor.dtype}; an fp8 checkpoint stores weight as {FP8_DTYPE} "
                             f"(quantization_config says {self.method})")
        if name == "weight_scale_inv" and tensor.dtype != torch.float32:
            raise ValueError(f"tensor {source!r} is {tensor.dtype}; an fp8 checkpoint stores weight_scale_inv as "
                             f"{torch.float32} (quantization_config says fp8)")
        if name == "weight_scale" and (not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE):
            raise ValueError(f"tensor {source!r} is {tensor.dtype}; a weight scale is a float16, bfloat16 or float32")
        bn = self.block_size[0]
        dest = self.weight.data[start:start + width] if name == "weight" else \
            self.weight_scale_inv.data[start // bn:(start + width) // bn]
        if self.per_tensor and name == "weight_scale":
            if tensor.numel() != 1:
                raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}; a per-tensor weight_scale "
                                 "holds one value")
            dest.fill_(float(tensor.reshape(())))
            self._loaded.add((part, name))
            return
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} for "
                             f"fp8 with weight_block_size {list(self.block_size)}, from config.json")
        dest.copy_(tensor)
        self._loaded.add((part, name))

    def _quantize_rows(self, part: int, dense: torch.Tensor, source: str) -> None:
        """Online fp8: one part's dense weight [rows, in] as e4m3 codes and one scale per row, the row's largest
        magnitude over 448 (e4m3's largest), computed in fp32."""
        start, width = sum(self.out_parts[:part]), self.out_parts[part]
        if not dense.is_floating_point() or dense.dtype == FP8_DTYPE:
            raise ValueError(f"tensor {source!r} is {dense.dtype}: quantization='fp8' quantizes a checkpoint's "
                             "float16, bfloat16 or float32 weights at load")
        full_in = self.in_features * (self.size if self.split == "in" else 1)
        if tuple(dense.shape) != (width, full_in):
            raise ValueError(f"tensor {source!r} has shape {tuple(dense.shape)}, expected ({width}, {full_in}) from "
                             "config.json")
        w = dense.to(self.weight.device, torch.float32)
        scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        if self.split == "in":  # the scale is the whole row's, the codes this rank's columns
            w = w[:, self.rank * self.in_features:(self.rank + 1) * self.in_features]
        self.weight.data[start:start + width] = (w / scale[:, None]).to(FP8_DTYPE)
        self.weight_scale_inv.data[start:start + width, 0] = scale
        self._loaded.update({(part, "weight"), (part, "weight_scale_inv")})

    def _columns(self, part: int, name: str) -> tuple[int, int]:
        """The columns of tensor `name` that part `part` fills."""
        start, width = sum(self.out_parts[:part]), self.out_parts[part]
        packed = name == "qzeros" or (name == "qweight" and self.method == "awq")
        div = self.pack if packed else 1
        return start // div, (start + width) // div

    def load(self, part: int, name: str, tensor: torch.Tensor, source: str) -> None:
        """Copy checkpoint tensor `name` (one of PACKED_TENSORS, or FP8_TENSORS) of part `part` in; `source` names it
        in errors."""
        if self.method in FP8_METHODS:
            self._load_fp8(part, name, tensor, source)
            return
        if self.method == "awq" and self.codes_along_k:
            raise RuntimeError(f"tensor {source!r}: this layer's weights are loaded and repacked already")
        if name not in PACKED_TENSORS:
            raise ValueError(f"unexpected tensor {source!r}: {self.method} checkpoints hold "
                             f"{', '.join(PACKED_TENSORS)}")
        if name == "g_idx":
            if self.method != "gptq":
                raise ValueError(f"unexpected tensor {source!r}: {self.method} checkpoints have no g_idx")
            if tuple(tensor.shape) != (self.in_features,):
                raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}, expected "
                                 f"({self.in_features},) from config.json")
            if self.split == "in" and not self.replicated_groups:  # this rank's groups are numbered from 0 here
                tensor = tensor - self.rank * (self.in_features // self.group_size)
            if any(n == "g_idx" for _, n in self._loaded) and not torch.equal(
                    self.g_idx.data, tensor.to(self.g_idx.device, torch.int32)):
                raise ValueError(f"tensor {source!r} differs from the g_idx of the projections it is fused with; "
                                 "fused projections (q/k/v, gate/up) must share one g_idx")
            groups = self.scales.shape[0]
            if tensor.numel() and not (int(tensor.min()) >= 0 and int(tensor.max()) < groups):
                raise ValueError(f"tensor {source!r} names groups outside 0..{groups - 1} (group_size "
                                 f"{self.group_size} of {self.in_features} input features, from config.json)")
            self.g_idx.data.copy_(tensor)
            self.groups_in_order = self.groups_in_order and torch.equal(
                tensor.to(torch.int32), torch.arange(self.in_features, dtype=torch.int32, device=tensor.device)
                // self.group_size)
        else:
            dest = getattr(self, name).data
            lo, hi = self._columns(part, name)
            dest = dest[:, lo:hi]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"tensor {source!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} "
                                 f"for {self.method} {self.bits}-bit, group_size {self.group_size}, from config.json")
            dest.copy_(tensor)
        self._loaded.add((part, name))

    def missing(self) -> list[str]:
        """Tensors no checkpoint tensor has filled yet, as 'part k name'."""
        if self.method in FP8_METHODS:
            names = list(self.tensor_names)
        else:
            names = ["qweight", "qzeros", "scales"] + (["g_idx"] if self._g_idx_required else [])
        return [f"part {k} {n}" for k in range(len(self.out_parts)) for n in names if (k, n) not in self._loaded]

    def repack(self) -> bool:
        """Once every tensor is loaded, put AWQ's codes in the layout the one-row kernels read fastest: packed along
        the input features as GPTQ's (qweight [in / 8, out]), zero points packed in column order and stored as they
        are (GPTQ v1 stores each less one, which a zero point of 0 would overflow). A split one-row product over that
        layout streams 1 KB of each packed row a program; over AWQ's own, 128 bytes of each input row (on an H200,
        91.2 against 131.3 us a llama3-8b layer). Exact (a permutation of bits); other layers are left as they are.
        Returns whether it repacked."""
        if self.method != "awq" or self.codes_along_k:
            return False
        packed = self.qweight.data
        qweight = torch.empty(packed.shape[0] // 8, packed.shape[1] * 8, dtype=torch.int32, device=packed.device)
        for start in range(0, packed.shape[0], _REPACK_ROWS):  # a slice at a time: the codes unpacked are 8x larger
            rows = packed[start:start + _REPACK_ROWS]
            qweight[start // 8:(start + rows.shape[0]) // 8] = pack_int32(unpack_awq(rows), 4, dim=0)
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.qzeros = nn.Parameter(pack_int32(unpack_awq(self.qzeros.data), 4, dim=-1), requires_grad=False)
        self.codes_along_k = True
        return True

    def codes_and_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [in, out], z [groups, out]): the unpacked integer codes and zero points."""
        if not self.codes_along_k:
            return unpack_awq(self.qweight), unpack_awq(self.qzeros)
        q = unpack_int32(self.qweight, self.bits, dim=0)
        z = unpack_int32(self.qzeros, self.bits, dim=-1)
        return q, z + 1 if self.method == "gptq" else z  # GPTQ v1 stores zero - 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in], computed in fp32 and returned in `dtype`: (q - z) * s per input feature's group (AWQ,
        GPTQ), or weight * weight_scale_inv per block (fp8)."""
        if self.method in FP8_METHODS:
            bn, bk = self.block_size
            out, inp = self.weight.shape
            scale = self.weight_scale_inv.repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]
            return (self.weight.float() * scale).to(dtype)
        q, z = self.codes_and_zeros()
        g = self.g_idx.long()
        w = (q - z[g]).float() * self.scales.float()[g]  # [in, out]
        return w.t().to(dtype)

    def one_row_rounding(self, x: torch.Tensor, kernels: LaunchPolicy | None) -> int | None:
        """The activation group (0: per token) by which the kernel writing this layer's input may round it for the
        layer (`RoundedInput`), or None. x: that kernel's input, [rows, ...] on the step's device. Rounded inputs are
        taken by one-row steps of a W8A8 layer on the fused path (`kernels`), with groups the norm kernel can form
        (`norm_rounding_supported`); several rows go to the e4m3 GEMMs, which take codes."""
        if (kernels is None or self.method not in FP8_METHODS or not self.quantize_activations or x.dim() != 2
                or x.shape[0] != 1 or not triton_usable(x)):
            return None
        assert self.activation_group is not None
        return self.activation_group if norm_rounding_supported(self.activation_group, self.in_features) else None

    def forward(self, x: torch.Tensor | RoundedInput, bias: torch.Tensor | None = None,
                kernels: LaunchPolicy | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) in x's dtype. W8A8 layers quantize x first (`_w8a8`), unless x comes rounded
        (`RoundedInput`). On the fused path (`kernels`: its launch policy) a one-row step streams the packed bytes
        through `fp8_gemv`, `awq_gemv` or `gptq_gemv`, a step of a few rows of AWQ or GPTQ with groups in order
        through `packed_gemm`, any other of several rows through `packed_dequantize` and a dense matmul; otherwise W
        is dequantized on every call by PyTorch ops (the reference path; slow on a GPU)."""
        if isinstance(x, RoundedInput):
            return self._times_rounded(x.values, bias, kernels, x.dtype)
        if self.method in FP8_METHODS and self.quantize_activations:
            return self._w8a8(x, bias, kernels)
        if kernels is not None and self.method in FP8_METHODS and fp8_gemv_usable(x, self.weight):
            return fp8_gemv(x, self.weight, self.weight_scale_inv, self.block_size, bias, policy=kernels)
        packed = kernels is not None and self.method in ("awq", "gptq")
        if packed and not self.codes_along_k and packed_gemv_usable(x, self.qweight):
            return awq_gemv(x, self.qweight, self.qzeros, self.scales, self.group_size, bias, policy=kernels)
        if packed and packed_gemv_usable(x, self.qweight):
            return gptq_gemv(x, self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, bias,
                             group_size=self.group_size if self.groups_in_order else None, policy=kernels,
                             zeros_minus_one=self.method == "gptq")
        if packed and self.codes_along_k and packed_gemm_usable(x, self.qweight, self.group_size, self.bits,
                                                                self.groups_in_order):
            return packed_gemm(x, self.qweight, self.qzeros, self.scales, self.bits, self.group_size, bias,
                               zeros_minus_one=self.method == "gptq", policy=kernels)
        if packed and packed_dequantize_usable(self.qweight, x):
            # Any other step (several rows beyond packed_gemm's, or a row the GEMVs do not take): the reference
            # path's product, its dense weight written by one kernel.
            w = packed_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx if self.codes_along_k else None,
                                  self.bits, self.group_size, x.dtype, zeros_minus_one=self.method == "gptq")
            return nn.functional.linear(x, w.t(), bias)
        return nn.functional.linear(x, self.dequantize(x.dtype), bias)

    def _w8a8(self, x: torch.Tensor, bias: torch.Tensor | None, kernels: LaunchPolicy | None) -> torch.Tensor:
        """x's tokens (or their groups of `activation_group` features) in e4m3 with dynamic scales, times the weight:
        for several rows, the codes through `fp8_block_gemm` on the fused path (block-scaled weights, and per-feature
        ones in a step its split launch takes) or `torch._scaled_mm` (one scale per token and per output feature);
        otherwise the values the codes stand for through the one-row GEMV or the reference path."""
        assert self.activation_group is not None
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        fused = kernels is not None and triton_usable(flat)  # the Triton quantizer, else the PyTorch reference
        group, rows = self.activation_group, flat.shape[0]
        if rows > 1 and kernels is not None and fused and (self.blocked or fp8_gemm_splits_k(rows, kernels)) \
                and fp8_block_gemm_usable(flat, self.weight, self.block_size, group):
            codes, scales = fp8_quantize(flat, group)
            y = fp8_block_gemm(codes, scales, group, self.weight, self.weight_scale_inv, self.block_size, bias, x.dtype,
                               policy=kernels)
        elif rows > 1 and group == 0 and not self.blocked and scaled_mm_usable(flat, self.weight):
            codes, scales = (fp8_quantize if fused else fp8_quantize_ref)(flat, 0)
            y = torch._scaled_mm(codes, self.weight.t(), scale_a=scales, scale_b=self.weight_scale_inv.view(1, -1),
                                 bias=bias, out_dtype=x.dtype)
        else:
            # The values the codes stand for, in float32, times the exact weight: what the GEMMs of the codes above
            # compute (exact products, float32 sums, one rounding), so a token's result does not depend on its step.
            rounded = (fp8_round if fused else fp8_round_ref)(flat, group, torch.float32)
            y = self._times_rounded(rounded, bias, kernels, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _times_rounded(self, rounded: torch.Tensor, bias: torch.Tensor | None, kernels: LaunchPolicy | None,
                       dtype: torch.dtype) -> torch.Tensor:
        """W8A8's input already rounded (float32 [rows, K]) times the exact weight, rounded once to `dtype`."""
        if kernels is not None and fp8_gemv_usable(rounded, self.weight):
            return fp8_gemv(rounded, self.weight, self.weight_scale_inv, self.block_size, bias, policy=kernels,
                            out_dtype=dtype)
        return nn.functional.linear(rounded, self.dequantize(), None if bias is None else bias.float()).to(dtype)
