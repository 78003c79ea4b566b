"""specd's engine: lossless, batched speculative decoding over transformers models."""

from engine.config import CompileMode, EngineConfig, SpeculativeMethod
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParamError, SamplingParams
from engine.sequence import TokenLogprob
from engine.stats import SpecDecodeStats, StepStats
from engine.structured.constraint import Constraint, ConstraintKind

__all__ = [
    "LLM",
    "CompileMode",
    "CompletionOutput",
    "Constraint",
    "ConstraintKind",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParamError",
    "SamplingParams",
    "SpecDecodeStats",
    "SpeculativeMethod",
    "StepStats",
    "TokenLogprob",
]
