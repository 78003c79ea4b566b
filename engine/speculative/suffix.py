"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from suffix tries with counts, one over the
request's own prompt and output, one over the outputs of recent requests (engine.speculative.suffix_index).

A request's tokens enter both as they are produced, all but its last one: the last token's occurrence
has no continuation yet, and leaving it out keeps the context's own current suffix from matching
itself. When the request ends (finished, aborted or failed: ``release``) the rest of its output enters
the global index, which keeps the ``max_requests`` most recent ended outputs, oldest out. A preempted
request keeps its tokens and its state, and only what is new is ever inserted, so recomputing it
inserts nothing twice.
"""

from __future__ import annotations

from collections import deque

from engine.speculative.source import DraftRequest, Proposal
from engine.speculative.suffix_native import AnyStream, TokenIndex, new_index
from engine.types.sequence import Sequence

DEPTH = 24  # longest path kept: ArcticInference's and vLLM's default
MIN_PROB = 0.1  # stop a draft once its running probability falls below this (Arctic's min_token_prob)
FACTOR, OFFSET = 1.0, 0.0  # draft at most match_len * FACTOR + OFFSET tokens (Arctic's max_spec_factor, _offset)


class GlobalSuffixCache:
    """The index over recent requests' outputs. Running requests' streams are in it too (a running request
    helps its neighbours); ``max_requests`` bounds the ended ones kept."""

    def __init__(self, max_requests: int, depth: int = DEPTH, native: bool | None = None) -> None:
        self.index: TokenIndex = new_index(depth, native)
        self.max_requests = max_requests
        self.live: set[AnyStream] = set()
        self.ended: deque[AnyStream] = deque()

    def open(self) -> AnyStream:
        stream = self.index.stream()
        self.live.add(stream)
        return stream

    def close(self, stream: AnyStream) -> None:
        """An ended request's output stays, as an output seen, until ``max_requests`` newer ones have ended."""
        self.live.discard(stream)
        self.ended.append(stream)
        while len(self.ended) > self.max_requests:
            self.index.remove(self.ended.popleft())

    @property
    def num_nodes(self) -> int:
        return self.index.num_nodes


class RequestSuffix:
    """One request's suffix state (on ``seq.draft.suffix``): its own index, and its stream in the global one."""

    __slots__ = ("index", "own", "shared", "start")

    def __init__(self, cache: GlobalSuffixCache, depth: int, start: int, native: bool | None) -> None:
        self.index = new_index(depth, native)
        self.own = self.index.stream()  # prompt and output
        self.shared: AnyStream | None = cache.open()  # the output, in the global index; None once released
        self.start = start  # where the output begins

    @property
    def synced(self) -> int:
        return len(self.own)


class SuffixSource:
    """One-hot proposals, like prompt lookup: the verifier's exact handling of them applies unchanged. Of
    the request's own draft and the global one, the one with the higher score (the sum of its running
    probabilities) is proposed. ``min_match``: shorter matches propose nothing. ``native``: False keeps the
    Python tries even where the C ones build (engine.speculative.suffix_native; benchmarks compare the two)."""

    name = "suffix"

    def __init__(self, max_requests: int, max_draft: int, min_match: int = 1, depth: int = DEPTH,
                 native: bool | None = None) -> None:
        self.native = native
        self.cache = GlobalSuffixCache(max_requests, depth, native)
        self.max_draft = max_draft
        self.min_match = min_match
        self.depth = depth

    def lag(self, seq: Sequence) -> int:
        return 0

    def drain_costs(self) -> list[tuple[int, float, bool]]:
        return []

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal(tokens=[self.draft(r.seq, r.max_drafts) for r in requests], probs=None)

    def draft(self, seq: Sequence, k: int) -> list[int]:
        state = self._sync(seq, len(seq.token_ids) - 1)
        limit = min(k, self.max_draft)
        if limit <= 0:
            return []
        context = seq.token_ids
        own, own_score = state.index.draft(context, limit, MIN_PROB, FACTOR, OFFSET, self.min_match)
        shared, shared_score = self.cache.index.draft(context, limit, MIN_PROB, FACTOR, OFFSET, self.min_match)
        return shared if shared_score > own_score else own

    def index_new(self, seqs: list[Sequence]) -> None:
        """Indexes the tokens of each of ``seqs`` not indexed yet, as its first draft would."""
        for seq in seqs:
            if not isinstance(seq.draft.suffix, RequestSuffix):
                self._sync(seq, len(seq.token_ids) - 1)

    def release(self, seq: Sequence) -> None:
        """The request ended (finished, aborted or failed): the rest of its output enters the global index
        and its stream there becomes evictable; its own index goes with the sequence."""
        state = seq.draft.suffix
        if not isinstance(state, RequestSuffix) or state.shared is None:
            return
        self._sync(seq, len(seq.token_ids))
        self.cache.close(state.shared)
        state.shared = None

    def _sync(self, seq: Sequence, upto: int) -> RequestSuffix:
        """Inserts the request's tokens [synced, upto) into its index, and the output among them into the
        global one."""
        state = seq.draft.suffix
        if not isinstance(state, RequestSuffix):
            state = RequestSuffix(self.cache, self.depth, seq.num_prompt_tokens, self.native)
            seq.draft.suffix = state
        done = state.synced
        if upto > done:
            tokens = seq.token_ids
            state.index.extend(state.own, tokens[done:upto])
            if state.shared is not None and upto > state.start:
                self.cache.index.extend(state.shared, tokens[max(done, state.start):upto])
        return state
