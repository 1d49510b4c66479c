"""The argmax of each row of a step's logits, as `torch.argmax(dim=1)` gives it: the index of the first largest value,
a NaN counting as larger than every number (the first NaN's index where a row has one).

A greedy step reads one token id per row from logits of a whole vocabulary (128,256 columns at the llama3 shapes).
PyTorch reduces such a row in one kernel that took 38 us on an H200 for one bf16 row, about 4% of a decode step of the
llama3.2-1b shape (scripts/profile-decode.py); here up to `ARGMAX_PROGRAMS` programs a row each reduce a slice of the
columns to its (largest value, first index), and a second kernel reduces a row's slices in order. Exact: comparisons
only, so the result is torch's whatever the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from governor.kernels.elementwise import chain_pdl, pdl_launch, triton_usable
from governor.kernels.launch_policy import LaunchPolicy, policy_for

ARGMAX_PROGRAMS = 128  # slices a row is cut into (at most; fewer for a short row)
_BLOCK = 1024  # columns a program reads at a time
_NO_INDEX = 2**31 - 1  # "no index yet": larger than every column
_NONE = tl.constexpr(_NO_INDEX)


@triton.jit
def _first_max(v, cols, best, best_idx, nan_idx):
    # Fold one tile (values v at columns cols, increasing, past any column folded before) into the running
    # (largest non-NaN value, its first index) and the first NaN's index. A tile's max replaces the running one only
    # when strictly larger, so the first index among equal values stays.
    m = tl.max(tl.where(v != v, float("-inf"), v), 0)
    idx = tl.min(tl.where(v == m, cols, _NONE), 0)
    take = (idx != _NONE) & ((m > best) | (best_idx == _NONE))
    return (tl.where(take, m, best), tl.where(take, idx, best_idx),
            tl.minimum(nan_idx, tl.min(tl.where(v != v, cols, _NONE), 0)))


@triton.jit
def _argmax_slice_kernel(x_ptr, val_ptr, idx_ptr, n, stride_x, SLICE: tl.constexpr, PROGRAMS: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, slice): columns [slice * SLICE, (slice + 1) * SLICE) of the row. A slice with a NaN reports the
    # NaN's index with a NaN value.
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], _NONE, tl.int32)
    nan_idx = tl.full([], _NONE, tl.int32)
    for off in range(0, SLICE, BLOCK):
        cols = s * SLICE + off + tl.arange(0, BLOCK)
        mask = (cols < n) & (off + tl.arange(0, BLOCK) < SLICE)
        v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        best, best_idx, nan_idx = _first_max(v, tl.where(mask, cols, _NONE), best, best_idx, nan_idx)
    has_nan = nan_idx != _NONE
    tl.store(val_ptr + row * PROGRAMS + s, tl.where(has_nan, float("nan"), best))
    tl.store(idx_ptr + row * PROGRAMS + s, tl.where(has_nan, nan_idx, best_idx))


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, PROGRAMS: tl.constexpr, PDL: tl.constexpr):
    # Program: one row's slices, in column order.
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    k = tl.arange(0, PROGRAMS)
    v = tl.load(val_ptr + row * PROGRAMS + k)
    idx = tl.load(idx_ptr + row * PROGRAMS + k)
    _, best_idx, nan_idx = _first_max(v, idx, tl.full([], float("-inf"), tl.float32),
                                      tl.full([], _NONE, tl.int32), tl.full([], _NONE, tl.int32))
    # idx of slices holding no column (a row shorter than the slices) are _NONE; all -inf: the first column
    out = tl.where(nan_idx != _NONE, nan_idx, tl.where(best_idx == _NONE, 0, best_idx))
    tl.store(out_ptr + row, out.to(tl.int64))


def argmax_usable(x: torch.Tensor, interpret: bool = False) -> bool:
    """Whether `argmax_rows` runs its kernels on x: 16- or 32-bit floats (compared in float32, exactly), 2-D,
    contiguous rows of under 2^31 columns, on a CUDA device, or (`interpret`) on any device under the Triton
    interpreter. On a CPU torch's argmax is the fast one: the interpreter runs each program in Python, so the engine's
    CPU path keeps torch's and only the kernels' own tests interpret them."""
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] < _NO_INDEX and (x.is_cuda or (interpret and triton_usable(x))))


def argmax_rows(x: torch.Tensor, policy: LaunchPolicy | None = None, *, interpret: bool = False) -> torch.Tensor:
    """torch.argmax(x, dim=1) for x [rows, n]: int64 [rows], in two small kernels where `argmax_usable(x,
    interpret)`, else torch's."""
    if not argmax_usable(x, interpret) or x.shape[0] == 0 or x.shape[1] == 0:
        return x.argmax(dim=1)
    rows, n = x.shape
    slice_len = triton.next_power_of_2(-(-n // ARGMAX_PROGRAMS))
    programs = triton.next_power_of_2(-(-n // slice_len))
    vals = torch.empty(rows, programs, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, programs, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    pdl = chain_pdl(policy or policy_for(x.device), x.device)
    _argmax_slice_kernel[(rows, programs)](x, vals, idx, n, x.stride(0), SLICE=slice_len, PROGRAMS=programs,
                                           BLOCK=min(_BLOCK, slice_len), PDL=pdl, **pdl_launch(pdl))
    _argmax_rows_kernel[(rows,)](vals, idx, out, PROGRAMS=programs, PDL=pdl, **pdl_launch(pdl))
    return out
