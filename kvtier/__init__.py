"""kvtier: an LLM inference engine built around a paged, prefix-reusing, tiered KV cache."""

from kvtier.config import ConfigError, EngineArgs
from kvtier.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "ConfigError", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `import kvtier` must not pay for torch
    if name == "LLM":
        from kvtier.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from kvtier import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
