"""The engine's drafting, assembled from its configuration: the sources, the goodput controller and its
start-up profile."""

from __future__ import annotations

from functools import partial

from engine.speculative.calibrate import calibrate
from engine.speculative.controller import GoodputController
from engine.speculative.draft_model import DraftModelSource
from engine.speculative.drafting import Drafting
from engine.speculative.eagle import EagleRunner, EagleSource
from engine.speculative.ngram import LookupSource
from engine.speculative.self_draft import SelfDraftSource
from engine.speculative.source import DraftSource
from engine.speculative.suffix import SuffixSource
from engine.types.config import EngineConfig, SpeculativeMethod
from engine.worker.model_runner import ModelRunner


def make_drafting(config: EngineConfig, target: ModelRunner, draft: ModelRunner | EagleRunner | None,
                  early_exit: ModelRunner | None, eos_ids: tuple[int, ...]) -> Drafting | None:
    """``draft``: the draft model's runner or an EAGLE head's; ``early_exit``: the target's first layers
    (self-speculation)."""
    if not config.speculates:
        return None
    method = config.speculative_method
    drafters: list[tuple[DraftSource, ModelRunner | EagleRunner | None]] = []
    if isinstance(draft, EagleRunner):
        drafters.append((EagleSource(draft, target, eos_ids, config.draft_confidence), draft))
    elif draft is not None:
        drafters.append((DraftModelSource(draft, target.vocab_size, eos_ids, config.draft_confidence), draft))
    if early_exit is not None:
        drafters.append((SelfDraftSource(early_exit, target.vocab_size, eos_ids, config.draft_confidence), early_exit))
    lookups: list[DraftSource] = []
    # At a fixed k the hybrid has no rates to compare: a lookup takes the step on a suffix match of two or
    # more tokens (a lone token recurs nearly everywhere, and its guesses rarely hold).
    strict = method is SpeculativeMethod.HYBRID and config.num_speculative_tokens is not None
    if config.uses_lookup:
        lookups.append(LookupSource(config.ngram_max, max(2, config.ngram_min) if strict else config.ngram_min))
    if config.uses_suffix:
        lookups.append(SuffixSource(config.suffix_cache_requests, config.suffix_max_draft, 2 if strict else 1))
    if config.num_speculative_tokens is not None:
        return Drafting(config, [source for source, _ in drafters], lookups, None)
    controller = GoodputController(config.k_max, [s.name for s, _ in drafters], [s.name for s in lookups],
                                   lookup_k_max=config.max_lookup_tokens, rows=config.max_num_seqs * (config.k_max + 1))
    assert target.cache is not None
    profile = partial(calibrate, controller, target, {s.name: r for s, r in drafters}, config.block_size,
                      config.max_num_batched_tokens, max_seqs=config.max_num_seqs)
    profile(num_blocks=target.cache.num_blocks)
    drafting = Drafting(config, [source for source, _ in drafters], lookups, controller)
    # A profile timed on eager forwards has their shape, not the compiled ones' (the embedded target: 8.2 ms for
    # one token's decode and 100 ms for 576 tokens eagerly, 2.9 and 86 ms compiled), and online correction moves
    # one scale and the sizes the steps happen to feed: re-timed once the compiled forwards serve.
    drafting.reprofile = lambda first, end: profile(num_blocks=end, first_block=first,
                                                    when="once the compiled forwards took over")
    return drafting
