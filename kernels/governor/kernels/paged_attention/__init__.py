"""Paged attention: KV-cache writes, decode and (chunked) prefill attention over a paged KV cache.

Each Triton kernel sits beside its plain-PyTorch reference (`write_kv_ref`, `paged_attention_ref`);
the references are the oracles in tests and the CPU production path for tiny models.

Modules, by what each owns:
- `kv_write`: `write_kv` and `rotary_write_kv` (kernels, references, the fp8 quantization of stored values).
- `reference`: `paged_attention_ref`, the attention oracle for decode and prefill.
- `checks`: the cache contract's constants (fp8 dtype and range, the int32 offset limit) and argument validation.
- `tiles`: the online-softmax inner loop the Triton attention kernels share.
- `splits`: the split-KV partition count of a decode launch and each sequence's partition size.
- `decode`: `paged_decode_attention` (and `rotary_decode_attention`, with the rotary and K/V write of a step of
  decodes folded in), the Triton decode kernel, its launch settings and the merge of split partials.
- `gluon_decode`: the Gluon decode kernel over an fp8 cache on sm_90 and which calls take it.
- `prefill`: `paged_prefill_attention` and its kernel.

Layout (the engine relies on it):
- `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim]; the token at slot
  `s` lives at block `s // block_size`, offset `s % block_size`.
- `block_tables`: int32 [num_seqs, max_blocks_per_seq]; entry `j` of row `i` is the block holding
  tokens `j * block_size .. (j + 1) * block_size - 1` of sequence `i`. Entries past the sequence's
  last block are never read.
- `seq_lens`: int32 [num_seqs]; tokens of context in the cache, including this step's queries
  (whose K/V `write_kv` has already stored).
- `query_start_loc`: int32 [num_seqs + 1]; the queries of sequence `i` are
  `q[query_start_loc[i]:query_start_loc[i + 1]]` and are the last `q_len_i` tokens of its context:
  query `j` sits at absolute position `seq_lens[i] - q_len_i + j` and attends causally to keys
  `0 ..` that position. Precondition (not checked on device, it would sync): `q_len_i <= seq_lens[i]`.
- GQA/MQA: query head `h` reads kv head `h // (num_q_heads // num_kv_heads)`.

A sequence with `seq_lens[i] == 0` (a padding row of a CUDA-graph batch) gets an all-zero output.

fp8 KV cache (`k_cache`/`v_cache` of dtype `torch.float8_e4m3fn`, q and out stay bf16/fp16/fp32):
- Every entry point then takes `k_scale`, `v_scale`: float32 [num_kv_heads], the layer's static
  per-head scales (positive; not checked on device, it would sync). Heads differ in range by orders
  of magnitude, so each gets its own; static, so CUDA graphs need no per-step update and cached
  prefix blocks stay valid forever. Non-fp8 caches take no scales (passing them is an error, so a
  misconfigured layer fails loudly instead of silently ignoring them).
- Stored value = e4m3(clamp(x / scale[head], -448, 448)), rounded to nearest even; read value =
  float(stored) * scale[head]. Saturating keeps an outlier from becoming NaN (e4m3fn has no inf).
- The kernels never materialize dequantized K/V: e4m3 values are exact in bf16/fp16/fp32, so a tile
  is converted to q's dtype losslessly, `k_scale[head]` folds into the softmax scale and
  `v_scale[head]` multiplies the accumulated output once per program.
- Decode with bf16 q multiplies in fp16 instead (q moved into fp16's range by an exact power of two,
  `tiles._fp16_range`): e4m3 -> fp16 is one conversion per two values, e4m3 -> bf16 three per two, and
  on an H100 those conversions, not HBM, bounded the bf16-q kernel (docs/design/decode-attention-kernels.md).
- On sm_90 with bf16/fp16 q, head_dim 64/128 and up to 16 query heads a kv head, fp8 decode runs
  `gluon_decode._gluon_decode_kernel` (Gluon: explicit layouts) with the same contract, math and partials;
  elsewhere, and under the interpreter, `decode._decode_kernel`.

Launch settings (tile sizes, warps, stages, register caps, the split, width and merge rules) are a
`governor.kernels.launch_policy.LaunchPolicy`: every entry point with a Triton or Gluon kernel takes `policy` (None: the
device's, `policy_for`), and an A/B script or a test chooses another with `dataclasses.replace`.
"""

from .checks import FP8_KV_DTYPE, FP8_MAX, INT32_OFFSET_ELEMENTS
from .decode import paged_decode_attention, rotary_decode_attention
from .kv_write import rotary_write_kv, rotary_write_kv_ref, write_kv, write_kv_ref
from .prefill import paged_prefill_attention
from .reference import paged_attention_ref
from .splits import decode_num_splits

__all__ = [
    "FP8_KV_DTYPE",
    "FP8_MAX",
    "INT32_OFFSET_ELEMENTS",
    "decode_num_splits",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_decode_attention",
    "rotary_write_kv",
    "rotary_write_kv_ref",
    "write_kv",
    "write_kv_ref",
]
