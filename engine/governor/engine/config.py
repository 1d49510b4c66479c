"""Engine configuration: static `EngineConfig` (fixed at start) and live `Knobs` (tunable per step)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "torch", "triton"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["fp8", "awq", "gptq", "compressed-tensors"]

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20


class Knobs(BaseModel):
    """Live knobs: a change applies at the next step boundary and never needs a restart."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(ge=1, description="Most sequences running in one step.")
    max_num_batched_tokens: int = Field(ge=1, description="Token budget of one step (prefill chunk size).")
    num_speculative_tokens: int = Field(default=0, ge=0, description="Speculation depth K (0 disables).")


class SpeculativeConfig(BaseModel):
    """vLLM-shaped speculative decoding settings. num_speculative_tokens is the initial K and its hard cap."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(ge=1, le=16, description="Initial K, also the hard cap of the K knob.")
    prompt_lookup_min: int = Field(default=1, ge=1, description="n-gram: shortest suffix to match.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram: longest suffix to match.")
    model: str | None = Field(default=None, description="draft_model: checkpoint directory of the draft, sharing "
                                                         "the target's tokenizer.")
    quantization: Quantization | None = Field(default=None, description="draft_model: the draft's weight "
                                              "quantization, as the engine's own for the target (unset: the draft "
                                              "checkpoint's own; 'fp8' on an unquantized draft quantizes it at load).")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft checkpoint directory")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' takes no 'model'")
        if self.method == "ngram" and self.quantization:
            raise ValueError("speculative method 'ngram' takes no 'quantization': it runs no draft model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        return self


class EngineConfig(BaseModel):
    """Static engine configuration. Hard caps bound every later knob change."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Local directory of a Hugging Face checkpoint.")
    tokenizer: str | None = Field(default=None, description="Tokenizer directory (default: the model's).")
    dtype: DType = "auto"
    device: Device = "auto"
    kv_cache_dtype: KVCacheDType = Field(default="auto", description="KV cache element type: 'auto' (the model "
                                         "dtype) or 'fp8' (e4m3 with static per-layer, per-kv-head scales).")
    block_size: int = Field(default=16, ge=1, le=256)
    max_model_len: int | None = Field(default=None, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1, description="Overrides memory-based sizing.")
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1, description="KV budget of each "
                                              "tensor-parallel rank (CPU default 256 MiB).")
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0, description="Fraction of each GPU's "
                                          "memory free after weights given to KV.")
    max_num_seqs: int = Field(default=256, ge=1, description="Initial max_num_seqs knob.")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="Initial max_num_batched_tokens knob.")
    max_num_seqs_cap: int | None = Field(default=None, ge=1, description="Hard cap (default: initial value).")
    max_num_batched_tokens_cap: int | None = Field(default=None, ge=1,
                                                   description="Hard cap (default: initial value).")
    num_speculative_tokens: int | None = Field(default=None, ge=0, description="Initial speculation depth K "
                                               "(default: the speculative config's K, which is also its cap).")
    seed: int = 0
    speculative_config: SpeculativeConfig | None = Field(default=None, description="Speculative decoding "
                                                         "(JSON on the command line).")
    align_prefill_chunks: bool = Field(default=True, description="End a prefill chunk that does not finish its "
                                       "prompt on a block boundary, so every chunk starts block-aligned as a "
                                       "prefix-cache hit does.")
    enable_prefix_caching: bool = Field(default=False, description="Reuse cached KV of shared prompt prefixes "
                                                                     "(on by default in `governor serve`).")
    attention_backend: AttentionBackend = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1, description="Ranks the model is split over (Megatron-style: "
                                      "attention heads and MLP columns; one process and device per rank; it must "
                                      "divide the attention heads, KV heads and intermediate size).")
    enforce_eager: bool = Field(default=False, description="Run every step eagerly. Otherwise, on CUDA devices, "
                                "decode and speculative-verification steps replay CUDA graphs captured at start "
                                "(on every tensor-parallel rank, all-reduces inside) for batch sizes up to "
                                "max_num_seqs_cap.")
    disable_custom_all_reduce: bool = Field(default=False, description="With tensor parallelism on CUDA, send "
                                            "every all-reduce through NCCL instead of sending small ones over "
                                            "peer-to-peer buffers (one-shot and two-shot kernels).")
    async_scheduling: bool = Field(default=True, description="While a step runs, schedule and launch the next "
                                   "one, its tokens fed on the device from the running step's, so the device "
                                   "does not wait on the host between steps. Applies to steps whose every "
                                   "request is greedy without logprobs and without draft tokens; "
                                   "other steps run one at a time.")
    quantization: Quantization | None = Field(default=None, description="Weight quantization. Unset: the "
                                              "checkpoint's own (config.json's quantization_config, or none). "
                                              "'fp8' on an unquantized checkpoint quantizes its decoder linears at "
                                              "load (e4m3, one scale per output feature); naming the checkpoint's "
                                              "own method checks it; any other combination is an error.")
    load_format: LoadFormat = Field(default="auto", description="'auto' reads the safetensors weights; 'dummy' "
                                    "draws random weights of the checkpoint's shapes from `seed` (config.json "
                                    "and tokenizer are still read; a pre-quantized config.json gets random packed "
                                    "tensors of its format), for benchmarks without the weights on disk.")

    @model_validator(mode="after")
    def _caps_hold_initial_knobs(self) -> EngineConfig:
        if self.max_num_seqs_cap is not None and self.max_num_seqs > self.max_num_seqs_cap:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} exceeds max_num_seqs_cap={self.max_num_seqs_cap}")
        if (self.max_num_batched_tokens_cap is not None
                and self.max_num_batched_tokens > self.max_num_batched_tokens_cap):
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} exceeds "
                             f"max_num_batched_tokens_cap={self.max_num_batched_tokens_cap}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > self.spec_cap:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} exceeds the speculative cap "
                             f"{self.spec_cap} (speculative_config.num_speculative_tokens"
                             + ("" if self.speculative_config else "; no speculative_config is set") + ")")
        return self

    @property
    def seqs_cap(self) -> int:
        return self.max_num_seqs_cap or self.max_num_seqs

    @property
    def tokens_cap(self) -> int:
        return self.max_num_batched_tokens_cap or self.max_num_batched_tokens

    @property
    def spec_cap(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def initial_knobs(self) -> Knobs:
        k = self.spec_cap if self.num_speculative_tokens is None else self.num_speculative_tokens
        return Knobs(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                     num_speculative_tokens=k)

    def non_default_settings(self) -> dict[str, object]:
        """Every setting that differs from its default (for experiment envelopes)."""
        return self.model_dump(exclude_defaults=True, exclude={"model"})
