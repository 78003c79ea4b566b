"""The losslessness audit: re-run a fraction of finished greedy requests with speculation off, at the
lowest priority, and count whether the outputs match. It proves in production what the tests prove on
tiny models: speculation never changes greedy output."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace

from engine.types.sequence import AuditCase, FinishReason, Sequence

logger = logging.getLogger(__name__)

_PREFIX = "audit:"
NEAR_TIE = 1e-4  # top-2 logit gap below which float rounding may legitimately flip the argmax


def is_audit(request_id: str) -> bool:
    return request_id.startswith(_PREFIX)


class AuditResult(enum.Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    NEAR_TIE = "near_tie"  # diverged where the target's top-2 logits were within NEAR_TIE


@dataclass
class Auditor:
    fraction: float

    def __post_init__(self) -> None:
        self._credit = 0.0  # deterministic thinning: every 1/fraction-th eligible request is audited

    def audit_for(self, seq: Sequence) -> Sequence | None:
        """The audit sequence to run for ``seq`` (just finished), or None. Eligible: greedy requests
        that finished normally after drafting, whose logits the request leaves untouched (no
        logit_bias, penalties, min_tokens, grammar or token healing), so the target's raw top-2 logprobs
        decide near-ties."""
        p = seq.params
        if (
            self.fraction <= 0.0 or seq.audit is not None or not p.greedy or seq.num_draft_tokens == 0
            or seq.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH)
            or p.logit_bias or p.uses_penalties or p.min_tokens or p.constraint is not None or seq.num_healed_tokens
        ):
            return None
        self._credit += self.fraction
        if self._credit < 1.0:
            return None
        self._credit -= 1.0
        # Stop strings are left out: the audit compares token ids, and ends at the same count.
        params = replace(p, max_tokens=seq.num_output_tokens, num_speculative_tokens=0, stop=(), logprobs=2)
        return Sequence(
            request_id=f"{_PREFIX}{seq.request_id}",
            token_ids=seq.token_ids[: seq.num_prompt_tokens],
            params=params,
            audit=AuditCase(seq.request_id, tuple(seq.output_token_ids)),
        )

    def judge(self, audit: Sequence) -> AuditResult:
        """Compare a finished audit with the output it re-ran."""
        assert audit.audit is not None
        got, want = audit.output_token_ids, list(audit.audit.output)
        if got == want:
            return AuditResult.MATCH
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if j < len(audit.logprobs) and len(audit.logprobs[j].top) == 2:
            (_, first), (_, second) = audit.logprobs[j].top
            if first - second < NEAR_TIE:
                return AuditResult.NEAR_TIE
        logger.error("losslessness audit: request %s differs from the target alone at output token %d "
                     "(speculative %s, target alone %s)", audit.audit.request_id, j,
                     want[j] if j < len(want) else None, got[j] if j < len(got) else None)
        return AuditResult.MISMATCH
