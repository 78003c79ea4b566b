"""Everything done once at start-up: models, tokenizer checks, KV cache sizing."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.core.plan_sizes import plan_loaded
from engine.models import exit_head
from engine.models.eagle_head import ARCHITECTURE, is_eagle_head
from engine.models.exit_head import ExitHead
from engine.parallel import launch
from engine.parallel.checks import check_target
from engine.parallel.mirror import Leader
from engine.parallel.worker import load_shard
from engine.speculative.calibrate import profile_blocks
from engine.speculative.eagle import EagleRunner
from engine.types.config import CompileMode, EngineConfig, SpeculativeMethod
from engine.worker import compile_cache, precompile
from engine.worker.compiled import BackgroundWarmUp, resolve_mode
from engine.worker.graphs import Buckets
from engine.worker.host_memory import keep_freed_memory
from engine.worker.loading import resolve_device, resolve_dtype
from engine.worker.model_runner import ModelRunner
from engine.worker.prompt_compile import PromptCompile

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048  # for a model whose config names no max_position_embeddings


class TokenizerMismatchError(ValueError):
    """The draft model does not share the target's tokenizer."""


@dataclass
class Loaded:
    target: ModelRunner
    draft: ModelRunner | EagleRunner | None  # a draft model, or an EAGLE head (method eagle, or hybrid)
    early_exit: ModelRunner | None  # the target's first layers, drafting over its cache (self-speculation)
    tokenizer: Any | None
    eos_ids: tuple[int, ...]
    max_model_len: int
    num_blocks: int  # the block manager's; the cache may hold more (a background compile's own)
    compile_mode: CompileMode = CompileMode.OFF  # what config.compile came to on this machine (resolve_mode)
    # The compile warm-ups still to run, in a thread of their own (CompileMode.BACKGROUND): not started yet.
    background: BackgroundWarmUp | None = None
    prompts: PromptCompile | None = None  # with it, the prompt graphs' compile: not started yet


def load_tokenizer(path: str, trust_remote_code: bool) -> Any | None:
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer at %s (%s): only token-id prompts will work", path, exc)
        return None


def eos_token_ids(path: str, runner: ModelRunner, tokenizer: Any | None) -> tuple[int, ...]:
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = runner.model.config.get_text_config().eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def check_same_tokenizer(target_tok: Any | None, draft_tok: Any | None, target: str, draft: str) -> None:
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise TokenizerMismatchError(
            f"draft model {draft} does not share the target's tokenizer ({target}): "
            f"vocabularies differ ({len(draft_tok)} vs {len(target_tok)} tokens). A draft must use the "
            "target's tokenizer; vocabularies that differ only by padding rows are fine."
        )


def use_cuda_graphs(config: EngineConfig, target: ModelRunner) -> bool:
    """The config's choice, or by default: on where the target runs on one GPU."""
    if config.cuda_graphs is None:
        return target.device.type == "cuda" and not target.split and config.tensor_parallel_size == 1
    return config.cuda_graphs


# FlexAttention's CUDA kernel takes one cache block as its key tile, and Triton's matrix product needs 16 rows
# or more there: smaller blocks failed to compile (seen on an H200, torch 2.11, blocks of 4).
FLEX_MIN_CUDA_BLOCK = 16


def use_paged_kernel(config: EngineConfig, target: ModelRunner) -> bool:
    """FlexAttention through the block table for bucketed forwards: the config's choice, or on CUDA where the
    blocks are large enough for its kernel."""
    small = target.device.type == "cuda" and config.block_size < FLEX_MIN_CUDA_BLOCK
    if config.paged_attention == "auto":
        return target.device.type == "cuda" and not small
    if config.paged_attention == "flex" and small:
        raise ValueError(f"paged_attention flex on CUDA needs block_size >= {FLEX_MIN_CUDA_BLOCK}, got "
                         f"{config.block_size}: use a larger block_size, or paged_attention gather")
    return config.paged_attention == "flex"


def default_draft_layers(target: ModelRunner, head: Path | None = None) -> int:
    """Self-speculation without --draft-layers: the depth the checkpoint's exit head (at ``head``) was trained for,
    else a third of the target's layers, at least one."""
    if head is not None:
        return exit_head.exit_layers(head)
    return max(1, len(target.layer_shapes) // 3)


def _exit_head(path: Path, target: ModelRunner, layers: int) -> ExitHead | None:
    """The target checkpoint's trained exit head when it was trained for this depth (engine.models.exit_head)."""
    text = target.model.config.get_text_config()
    head = exit_head.load(path, text.hidden_size, target.vocab_size)
    if head.exit_layers != layers:
        logger.info("the exit head in %s is for draft_layers %d: drafting from %d layers reads through the target's "
                    "LM head", path, head.exit_layers, layers)
        return None
    logger.info("self-drafting through the trained exit head in %s (%d of %d tokens)", path, head.draft_vocab_size,
                head.vocab_size)
    return head


def sharded(config: EngineConfig, device: torch.device, eagle: bool) -> Leader | None:
    """With tensor_parallel_size > 1, the ranks (started, or joined under torchrun) once the target is known to
    shard; rank 0 is this process."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    target = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    check_target(size, target, device.type, torch.cuda.device_count() if device.type == "cuda" else None, eagle)
    return launch.start(size, device.type)


def _ahead_of_time(compiled: list[ModelRunner], config: EngineConfig, device: torch.device, split: bool, eagle: bool,
                   early_exit: object) -> bool:
    """``--compile start`` on CPU: the graphs a background compile would serve (its files, or a child that writes
    them, waited for here), which a later start loads at once. This process's own torch.compile (every shape
    dynamic, where the files' graphs fix all but the attention metadata's) served quoting at 64 sequences 0.94x as
    fast (docs/performance.md#compiling). False, installing nothing, where the files cannot serve (the cases
    background compiles at start too) or the child fails."""
    if device.type != "cpu" or split or eagle or early_exit is not None or not compiled:
        return False
    try:  # prompt graphs too, before serving (a background compile builds them after its decode graphs serve)
        precompile.compile_prompts(compiled, config.k_max, config.dtype, config.trust_remote_code)
    except RuntimeError as exc:
        logger.warning("%s; prompt chunks run eagerly", exc)
    if not (precompile.at_start(compiled, config.k_max)
            or precompile.background(compiled, config.k_max, config.dtype, config.trust_remote_code)()):
        return False
    logger.info("compile start: %s serve graphs compiled ahead of time", " and ".join(r.name for r in compiled))
    for runner in compiled:
        runner.compiled.frozen = True
    return True


def load(config: EngineConfig) -> Loaded:
    t0 = time.perf_counter()
    eagle = config.uses_draft_model and is_eagle_head(config.draft_model or "")
    device = resolve_device(config.device)
    split = config.device_map is not None
    leader = sharded(config, device, eagle)
    if leader is not None:
        logger.info("compile: off (the sharded forwards run eagerly)")
        mode = CompileMode.OFF
    else:
        mode = resolve_mode(config.compile, device, resolve_dtype(config.dtype, device), split, eagle)  # type: ignore[arg-type]
    compiles = mode is not CompileMode.OFF
    if compiles and device.type == "cpu" and os.path.isdir(config.model):
        compile_cache.seed(config.model)  # a cache shipped with the model: a first start compiles as a warm one
    if leader is not None:
        leader.load(config)
        target = load_shard(config, leader.ranks)
    else:
        target = ModelRunner.load(config.model, config.dtype, config.device, config.trust_remote_code,
                                  config.device_map, compiles)
    if "cpu" in {d.type for d in target.layer_devices or [target.device]}:
        keep_freed_memory()  # a batched step's large temporaries met fresh pages from the kernel in some processes
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    draft: ModelRunner | EagleRunner | None = None
    if config.speculative_method is SpeculativeMethod.EAGLE and not eagle:
        raise ValueError(f"speculative_method 'eagle' needs draft_model to be an EAGLE-3 head (a config.json with "
                         f"architectures [{ARCHITECTURE!r}]); {config.draft_model} is not one")
    if config.speculative_method is SpeculativeMethod.DRAFT_MODEL and eagle:
        raise ValueError(f"draft_model {config.draft_model} is an EAGLE-3 head, not a draft model: use "
                         "speculative_method 'eagle' (or 'hybrid')")
    if eagle:
        assert config.draft_model is not None
        draft = EagleRunner.load(config.draft_model, target)
        target.capture_aux(draft.aux_ids)
    elif config.uses_draft_model:
        assert config.draft_model is not None
        draft_tok = load_tokenizer(config.draft_model, config.trust_remote_code)
        check_same_tokenizer(tokenizer, draft_tok, config.model, config.draft_model)
        draft = ModelRunner.load(config.draft_model, config.dtype, config.device, config.trust_remote_code,
                            compile=compiles)
        if draft.device != target.device:
            # The draft's distributions meet the target's logits in verification, on one device.
            raise ValueError(f"the draft model is on {draft.device} but the target's inputs and logits are on "
                             f"{target.device}; put the draft there (device {target.device})")
    limits = [r.max_position_embeddings for r in (target, draft)
              if isinstance(r, ModelRunner) and r.max_position_embeddings]
    model_limit = min(limits) if limits else DEFAULT_CONTEXT
    plan = plan_loaded(config, target.model, target.bytes_per_block(config.block_size),
                       None if draft is None else draft.head if isinstance(draft, EagleRunner) else draft.model,
                       draft.bytes_per_block(config.block_size) if draft else 0, target.device, target.dtype,
                       model_limit, use_cuda_graphs(config, target) and not eagle, split, config.tensor_parallel_size)
    for warning in plan.warnings:
        logger.warning(warning)
    logger.info("%s", plan.describe())
    max_model_len, num_blocks, block_bytes, sizing = plan.max_model_len, plan.num_blocks, plan.block_bytes, plan.sizing
    # A background compile writes its warm-up forwards into blocks of its own, past the block manager's, and then
    # the goodput controller's profile of the compiled forwards (up to a sixteenth more blocks than the plan's).
    reserved = 0
    if mode is CompileMode.BACKGROUND:
        adaptive = config.speculates and config.num_speculative_tokens is None
        profile = profile_blocks(config.k_max, config.block_size, config.max_num_batched_tokens,
                                 config.max_num_seqs) if adaptive else 0
        reserved = max(ModelRunner.warm_up_blocks(config.k_max, config.block_size), min(profile, num_blocks // 16))
    if leader is not None:
        leader.allocate(num_blocks + reserved, config.block_size)
    target.allocate_cache(num_blocks + reserved, config.block_size)
    target.leader = leader
    if draft:
        draft.allocate_cache(num_blocks + reserved, config.block_size)
    early_exit = None
    if config.uses_self_draft:
        head_path = exit_head.find(config.model) if config.exit_head else None
        layers = config.draft_layers if config.draft_layers is not None else default_draft_layers(target, head_path)
        head = _exit_head(head_path, target, layers) if head_path is not None else None
        early_exit = ModelRunner.early_exit(target, layers, head)
    compiled = [r for r in (target, draft, early_exit) if isinstance(r, ModelRunner) and r.compiled is not None]
    background = None
    prompts = PromptCompile(compiled, config.k_max, config.dtype, config.trust_remote_code) if (
        mode is CompileMode.BACKGROUND and early_exit is None and compiled and config.compile_prompts) else None
    if mode is CompileMode.BACKGROUND and early_exit is None and precompile.at_start(compiled, config.k_max):
        logger.info("compile background: %s serve compiled from the start (their graphs were on disk)",
                    " and ".join(r.name for r in compiled))
        for runner in compiled:
            runner.compiled.frozen = True
        num_blocks += reserved  # no warm-up and no re-profile writes in them
    elif mode is CompileMode.BACKGROUND:
        logger.info("compile background: serving eagerly while %s compile", " and ".join(r.name for r in compiled))
        # In a child process, loaded when done; in a thread here where a model is not its own checkpoint (an
        # early exit shares the target's layers) or the child fails.
        child = precompile.background(compiled, config.k_max, config.dtype, config.trust_remote_code) \
            if early_exit is None else None
        background = BackgroundWarmUp([
            (r.compiled, lambda r=r: r.warm_up_compiled(config.k_max, num_blocks)) for r in compiled  # type: ignore[misc]
        ], child)
    elif not (mode is CompileMode.START and _ahead_of_time(compiled, config, device, split, eagle, early_exit)):
        for runner in compiled:
            runner.warm_up_compiled(config.k_max)
    graphs = use_cuda_graphs(config, target)
    if graphs and eagle:
        if config.cuda_graphs:
            raise ValueError("cuda_graphs is not yet available with an EAGLE head (the bucketed forwards do not hand "
                             "it the target's hidden states); leave cuda_graphs unset or false")
        logger.warning("an EAGLE head drafts: decode and verify forwards run without CUDA graphs for now")
        graphs = False
    if graphs:
        buckets = Buckets.for_limits(config.max_num_seqs, config.k_max, max_model_len, config.block_size)
        for runner in (target, draft, early_exit):
            if isinstance(runner, ModelRunner):
                runner.use_buckets(buckets, use_paged_kernel(config, target))
                assert runner.static is not None
                seconds = runner.static.capture_all()
                if seconds:
                    logger.info("captured %d CUDA graphs of %s in %.1fs", len(runner.static.graphs), runner.name,
                                seconds)
    logger.info(
        "loaded %s%s on %s (%s) in %.1fs; KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s); "
        "max_model_len %d",
        config.model,
        (f" with {'EAGLE-3 head' if eagle else 'draft'} {config.draft_model}" if draft else "")
        + (f", self-drafting from {early_exit.name}" if early_exit else ""),
        ", ".join(str(d) for d in dict.fromkeys(target.layer_devices)) if target.split else target.device,
        str(target.dtype).removeprefix("torch."),
        time.perf_counter() - t0,
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        num_blocks * block_bytes / 2**20,
        sizing,
        max_model_len,
    )
    eos = eos_token_ids(config.model, target, tokenizer)
    return Loaded(target, draft, early_exit, tokenizer, eos, max_model_len, num_blocks, mode, background, prompts)
