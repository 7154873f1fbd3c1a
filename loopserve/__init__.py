"""loopserve: an inference and serving engine for looped language models."""

from loopserve.errors import CapacityError, ConfigError, InvalidRequestError, ModelLoadError
from loopserve.sampling_params import SamplingParams, StructuredOutput


def __getattr__(name: str):
    # Lazy: importing the package for SamplingParams should not load torch.
    if name == "LLM":
        from loopserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from loopserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "RequestOutput":
        from loopserve.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)


__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "ConfigError",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "__version__",
]
