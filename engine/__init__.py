"""specd's engine: lossless, batched speculative decoding over transformers models.

This module and ``engine.llm`` are the engine's public face: server/ and recipe/ import from here only (an
import-linter contract in pyproject.toml holds them to it). Below it the subpackages, each importing only
those listed after it: core, speculative | parallel, sample | worker, models | sched | structured | layers,
types | native."""

from engine.core.audit import AuditResult
from engine.core.dry_run import DryRun, dry_run
from engine.core.llm_engine import LLMEngine, check_text
from engine.core.memory_plan import MemoryPlan, PlanError, parse_size
from engine.llm import LLM
from engine.models import exit_head
from engine.models.eagle_head import Eagle3Head, aux_layer_ids, save_head
from engine.models.early_exit import decoder_layers, truncate
from engine.models.exit_head import ExitHead
from engine.parallel.worker import follow_rank
from engine.types.config import CompileMode, EngineConfig, SpeculativeMethod
from engine.types.constraint import Constraint, ConstraintKind
from engine.types.draft_state import GRAMMAR_SOURCE
from engine.types.errors import SamplingParamError
from engine.types.outputs import CompletionOutput, RequestOutput
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import TokenLogprob
from engine.types.stats import ForwardCounts, SourceStats, StepStats, StepTotals
from engine.worker.compile_cache import archive as compile_cache_archive
from engine.worker.compile_cache import pack as pack_compile_cache
from engine.worker.precompile import compile_prompt_files

__all__ = [
    "GRAMMAR_SOURCE",
    "LLM",
    "AuditResult",
    "CompileMode",
    "CompletionOutput",
    "DryRun",
    "Constraint",
    "ConstraintKind",
    "Eagle3Head",
    "EngineConfig",
    "ExitHead",
    "ForwardCounts",
    "LLMEngine",
    "MemoryPlan",
    "PlanError",
    "RequestOutput",
    "SamplingParamError",
    "SamplingParams",
    "SourceStats",
    "SpeculativeMethod",
    "StepStats",
    "StepTotals",
    "TokenLogprob",
    "aux_layer_ids",
    "check_text",
    "decoder_layers",
    "dry_run",
    "exit_head",
    "follow_rank",
    "compile_cache_archive",
    "compile_prompt_files",
    "pack_compile_cache",
    "parse_size",
    "save_head",
    "truncate",
]
