"""The kernels' launch settings as data: `LaunchPolicy`, the policies by GPU architecture, and `policy_for(device)`.

Every launcher takes a `policy` (None: its device's, `policy_for`) and reads its tile sizes, warps, stages, register
caps and its split, width and merge rules from it; nothing else about a launch is tunable. A caller that runs many
launches (the engine's attention) picks its device's policy once and passes it on; a test or an A/B script chooses
another with `dataclasses.replace(policy, field=value)`. The measurements behind each value are in
docs/design/decode-attention-kernels.md (attention, rotary) and docs/design/gemv.md (GEMV).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class GemvConfig(NamedTuple):
    """One `gemv` launch shape."""

    # Output columns (rows of w) per program.
    block_n: int
    # Reduction columns per loop step.
    block_k: int
    num_warps: int


@dataclass(frozen=True)
class LaunchPolicy:
    """Every tunable launch setting of the Triton and Gluon kernels: one field each, above it why it has its value."""

    # --- Paged attention: the Triton kernels' key tile and split-KV (`paged_attention.splits`).
    # Keys a step of the 16-bit decode and of the prefill loop (32 KiB of bf16 K/V); split-KV partitions are whole
    # multiples of it.
    tile_n: int = 64
    # Shortest partition of a context_bound-long context: shorter ones cost more in the merge than they gain.
    split_min_partition: int = 512
    # Most splits a launch runs: the merge holds all of a row's partials at once.
    split_max: int = 64
    # Programs per SM a 16-bit split count aims at (rounded up): 3, not 4, splits batch 32 x 8 kv heads 2 ways, one
    # wave: 78% -> 90% of the copy at 4K.
    programs_per_sm: int = 3
    # The same over an fp8 cache, rounded down to fit one wave: the register-capped Triton program's occupancy.
    programs_per_sm_fp8: int = 4

    # --- The Triton decode kernel (`paged_attention.decode`). Wide launches: unsplit fp8 ones that fill their waves
    # of 1-warp programs (`decode._wide_decode`); narrow: every other fp8 launch.
    # Warps of a 16-bit program: 8 helped at 4K and lost at batch 256 (H100).
    decode_num_warps_16: int = 4
    # Keys a step of a narrow fp8 program, the bytes of 16-bit's 64: 66% -> 79% of the copy at batch 256 (H100).
    decode_tile_n_fp8: int = 128
    # Warps of a narrow fp8 program: 4 beat 8 at every fp8 shape measured.
    decode_num_warps_fp8: int = 4
    # Stages of every fp8 launch: 1-2% faster than Triton's 3 at every fp8 shape (16-bit keeps 3: 2 lost 5-8%).
    decode_num_stages_fp8: int = 2
    # Register cap of a narrow fp8 program: 4 programs a SM instead of 3 (168 registers uncapped), which the fp8
    # split counts fill in one wave.
    decode_maxnreg_fp8: int | None = 128
    # Warps of a wide program: one warp owns the whole tile, with no cross-warp max, sum or P exchange.
    decode_wide_num_warps_fp8: int = 1
    # Keys a step of a wide program: 32 keys were 5-7% slower at batch 256.
    decode_wide_tile_n_fp8: int = 64
    # Wide programs a SM in a wave: the measured times step in waves of about 8.
    decode_wide_programs_per_sm_fp8: int = 8
    # Least fill of those waves for a launch to go wide: 2-4% faster at 97%, 17-86% slower at 36-73%.
    decode_wide_min_wave_fill: float = 0.9
    # Most splits merged inside the decode kernel (no second kernel): one program merging 47-64 partials was slower.
    decode_fold_max_splits: int = 8
    # Whether the reduce kernel runs under programmatic dependent launch where the GPU has it: 1.3-2.4 us a call.
    decode_reduce_pdl: bool = True

    # --- The Gluon fp8 decode kernel (`paged_attention.gluon_decode`).
    # Whether fp8 decode takes the Gluon kernel where it can (`_gluon_decode`): 43-45% fewer instructions a key.
    gluon_decode: bool = True
    # Keys a step where the programs fit one wave of programs_per_sm_fp8 a SM (every split launch): beat 32.
    gluon_tile_n_narrow: int = 64
    # Keys a step of larger launches: beat 32 and 64 at 1,024-2,048 programs.
    gluon_tile_n_wide: int = 16
    # Depth of the cp.async ring: 2 stages were slower, 4 the same.
    gluon_stages: int = 3
    # Register cap of the 16-key program (None: ptxas's 128): a cap of 168 lost 17-20% at batch 256.
    gluon_maxnreg_wide: int | None = None

    # --- Prefill (`paged_attention.prefill`).
    # (query token, group head) rows a program packs, so each K/V tile it reads serves all of them.
    prefill_block_m: int = 64

    # --- rotary_write_kv (`paged_attention.kv_write`).
    # Warps of a program without per-head norms (1 warp was 1-3% slower, llama3-8b) or over more tokens than below.
    rotary_num_warps: int = 4
    # Warps with per-head q/k RMSNorms (Qwen3): the norm's sum stays in a warp, 6.57 -> 4.93 us at 256 tokens.
    rotary_qk_norm_num_warps: int = 1
    # Most tokens a call takes on one warp: the largest call measured so (prefill chunks were not).
    rotary_one_warp_max_tokens: int = 256

    # --- gemv.
    # The fastest single configuration over a llama3-8b layer on an H100 and an H200 (docs/design/gemv.md). A launch
    # takes the largest K step up to block_k that divides K (`gemv.block_k_for`): masked steps cost up to 2x.
    gemv: GemvConfig = GemvConfig(block_n=4, block_k=2048, num_warps=4)  # noqa: RUF009 (a tuple: immutable)
    # The fp8 GEMV's tile: a byte a weight, so twice the columns a step for the same bytes, and 8 rows. On an H200,
    # per llama3-8b layer 66.1 us against 70.3 with the 16-bit tile (down alone: 20.3 against 17.9 us with 4 rows).
    fp8_gemv: GemvConfig = GemvConfig(block_n=8, block_k=4096, num_warps=4)  # noqa: RUF009
    # Whether AWQ's and GPTQ's grouped one-row products split K (`packed_gemv._packed_split_kernel`): on an H200 a
    # llama3-8b layer (qkv + o + gate_up + down, int4 in groups of 128) took 72.2 us split against 290.7 unsplit in
    # GPTQ's layout (which AWQ is repacked into at load), 131.3 against 2,328 in AWQ's own (docs/design/gemv.md).
    packed_split: bool = True
    # The split's tile in GPTQ's layout: output features a program takes, most input features (chunk), most packed
    # rows (int32 words a column) a K step takes (16: 128 inputs of 4 bits, 64 of 8), and warps. Of 256/512/1,024
    # columns on 2/4/8 warps (every warp along the columns), chunks of 128/256 and steps of 8/16 rows, 256 x 128 on 2
    # warps with 16-row steps was best over a 4-bit layer (72.2 us, one K step a program; 256 x 256 on 4 warps, the
    # tile before, 86.4). gate_up alone is 2 us faster on 1,024 x 256 with 4 warps. 8-bit codes take the same tile,
    # not swept.
    packed_split_block_n: int = 256
    packed_split_chunk: int = 128
    packed_split_rows: int = 16
    packed_split_warps: int = 2
    # AWQ's own layout (only `awq_gemv` called on AWQ's tensors as stored: the engine repacks them into GPTQ's): its
    # columns, chunk and warps, the tile it was measured with (131.3 us a layer); on 2 warps its unpacking spills.
    packed_split_awq_tile: tuple[int, int, int] = (256, 256, 4)
    # Whether the split kernel launches under programmatic dependent launch where `step_pdl` has it. Its programs
    # wait before their first read, so launching early only holds SM slots. An exploratory kernel without PDL (which
    # also added its partials in a loop; not kept) took 75.7 us a layer against the shipped 91.0; the sweep's "no
    # PDL" variant, this field alone, took 90.2 against 91.0 (H200), and 85.5 against 86.4 with the kernel of today
    # on the 256 x 256 tile: 0.2 us a product, so left on until an end-to-end run says otherwise. Not measured on the
    # 256 x 128 tile.
    packed_split_pdl: bool = True
    # Steps of 2 to PACKED_GEMM_MAX_ROWS rows over AWQ's and GPTQ's codes in groups in order
    # (`packed_gemm._packed_gemm_split_kernel`: decode batches, verification steps): per most rows a step has, the
    # output features a program takes, most input features (chunk) and warps. Over a llama3-8b int4 layer on an
    # H200 (`scripts/quantized-gemv-sweep.py --gemm-rows M`, docs/performance/quantized-weights.md): at 8 rows 64 x
    # 1,024 on 4 warps was best (175 us) of 64/128 columns, chunks of 512/1,024 and 4/8 warps; at 16 rows 128 x 512
    # on 4 warps (161 us; 64 x 1,024: 238); at 32 rows 256 x 1,024 on 8 warps (328 us; 64 x 1,024: 668).
    packed_gemm_tiles: tuple[tuple[int, tuple[int, int, int]], ...] = (
        (8, (64, 1024, 4)), (16, (128, 512, 4)), (32, (256, 1024, 8)))
    # W8A8 products of several rows (`fp8_gemm._fp8_block_gemm_kernel`). Steps of up to fp8_gemm_split_max_rows rows
    # (decode batches, verification steps) split K, over block-scaled and per-feature weight scales alike: output
    # features a program takes, most input features (chunk), warps and pipeline stages. Per llama3-8b layer on an
    # H200, 128 x 128 blocks (`scripts/quantized-gemv-sweep.py --formats fp8 --gemm-rows M`): 93.8 us at 8 rows and
    # 114.5 at 32 on this tile (1 stage: 133.9 and 163.3; torch._scaled_mm over per-feature scales 118.8 and 118.3;
    # the tiled launch at best 123.3 and 136.0); at 64 rows the tiled launch wins (150.4 against 183.6).
    fp8_gemm_split_max_rows: int = 32
    fp8_gemm_split_tile: tuple[int, int, int, int] = (64, 1024, 4, 3)
    # Longer steps over block-scaled weights (prefill chunks; per-feature ones take torch._scaled_mm, faster there),
    # each program over all of K: rows, output features, warps and pipeline stages. In 3 stages 150.4 us a layer at
    # 64 rows and 405.8 at 512 (128 x 128 on 8 warps: 206.4 and 397.6; 16 x 64 on 4 warps, the tile before: 185.0
    # and 1,301); 4 stages were 2-5% faster on qkv, gate_up and down at 64 and 512 rows.
    fp8_gemm_tile: tuple[int, int, int, int] = (64, 128, 4, 4)

    # --- The decode chain: the one-token step's GEMVs, add + RMSNorm, rotary + KV write and decode attention.
    # Whether they launch under programmatic dependent launch where the GPU has it (`elementwise.chain_pdl`): each
    # lets the next start at its own start, and a GEMV reads its first weight tile before waiting for its input.
    step_pdl: bool = True
    # Whether a step of decodes only folds rotary + K/V write into the Triton decode kernel
    # (`paged_attention.rotary_decode_attention`): one kernel boundary fewer a layer.
    decode_rotary: bool = True

    # --- The all-reduce + add + RMSNorm of tensor parallelism (`reduce_norm`).
    # Most rows a call sends as tagged 8-byte packets (no flags and no fence before them) rather than rows and flags.
    # At TP 2 on 2 H200s (llama3-8b shape): one row 4.8 us against 5.0 (`bench all-reduce`), a batch-1 decode step
    # 2.71-2.72 ms against 2.74-2.75; with packets up to 8 rows, a batch-8 step 3.33-3.34 ms against 3.30.
    reduce_norm_packet_max_rows: int = 1

    # --- Elementwise kernels (`elementwise`).
    # Columns a SiLU·mul program covers: 8 values a thread of Triton's default 4 warps.
    silu_block: int = 1024
    # Values per warp of a row norm (add_rms_norm), a few a thread: hidden 4096 gets 8 warps, 16 values each.
    row_values_per_warp: int = 512
    # Most warps of a row norm program.
    row_max_warps: int = 16


DEFAULT_POLICY = LaunchPolicy()
# Policies by architecture ("sm_90": CUDA compute capability 9.0); any other device, the CPU (the interpreter)
# included, runs "default". Every setting was measured on sm_90 (H100, H200), so no architecture has its own yet.
POLICIES: dict[str, LaunchPolicy] = {"default": DEFAULT_POLICY}


# A JSON object of LaunchPolicy fields that every policy_for_arch answer takes instead of its own values, e.g.
# '{"decode_rotary": false}': for A/B measurements of whole engines. It is read in every process that looks a policy
# up, tensor-parallel workers included (they inherit the environment).
POLICY_ENV = "GOVERNOR_LAUNCH_POLICY"


def policy_for_arch(arch: str) -> LaunchPolicy:
    """The policy of an architecture named as in POLICIES (e.g. "sm_90"), or the default one; with the fields
    POLICY_ENV sets, if it is set."""
    return with_overrides(POLICIES.get(arch, POLICIES["default"]), os.environ.get(POLICY_ENV, ""))


def with_overrides(policy: LaunchPolicy, text: str) -> LaunchPolicy:
    """`policy` with the fields of `text`, a JSON object (empty: none); a list stands for a tuple. ValueError naming
    the fields for anything else."""
    if not text.strip():
        return policy
    names = [f.name for f in dataclasses.fields(LaunchPolicy)]
    try:
        values = json.loads(text)
        problem = "" if isinstance(values, dict) else f"got {type(values).__name__}"
    except json.JSONDecodeError as e:
        values, problem = {}, str(e)
    unknown = sorted(set(values) - set(names))
    if problem or unknown:
        raise ValueError(f"{POLICY_ENV} must be a JSON object of LaunchPolicy fields ("
                         f"{problem or 'unknown: ' + ', '.join(unknown)}); fields: {', '.join(names)}")

    def as_field(old: Any, new: Any) -> Any:
        if isinstance(new, list):
            value = tuple(as_field(None, v) for v in new)
            return GemvConfig(*value) if isinstance(old, GemvConfig) else value
        return new

    fields = {f.name: f for f in dataclasses.fields(LaunchPolicy)}
    changed = {}
    for name, raw in values.items():
        old, new = getattr(policy, name), as_field(getattr(policy, name), raw)
        fits = (isinstance(new, type(old)) or (type(old) is float and type(new) is int) or old is None
                or (new is None and "None" in str(fields[name].type)))
        if not fits or (type(old) is int and type(new) is bool):
            raise ValueError(f"{POLICY_ENV}: {name} takes a value like {old!r}, got {raw!r}")
        changed[name] = new
    return dataclasses.replace(policy, **changed)


@functools.cache
def policy_for(device: torch.device) -> LaunchPolicy:
    """The launch policy of `device`'s architecture (looked up once per device)."""
    if device.type != "cuda":
        return policy_for_arch(device.type)
    major, minor = torch.cuda.get_device_capability(device)
    return policy_for_arch(f"sm_{major}{minor}")
