"""Governor's inference engine: paged KV cache, continuous batching, chunked prefill.

Offline use mirrors vLLM: `from governor.engine import LLM, SamplingParams`.
"""

from governor.engine.config import EngineConfig, Knobs
from governor.engine.llm import LLM
from governor.engine.outputs import CompletionOutput, RequestOutput
from governor.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Knobs", "RequestOutput", "SamplingParams"]
