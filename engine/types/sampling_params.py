"""Per-request decoding parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.types.errors import SamplingParamError

if TYPE_CHECKING:
    from engine.types.constraint import Constraint

# Below this a temperature is greedy: dividing float32 logits by it would overflow to inf and turn the
# softmax into NaN, and the distribution it approaches is the argmax anyway (vLLM draws the same line).
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. Validated on construction; every error names its field.

    temperature == 0 means greedy. ``num_speculative_tokens`` overrides the engine's draft
    length for this request (0 turns speculation off for it, None keeps the engine's policy).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; N: the emitted token's logprob plus top-N
    # None: none; N: every prompt token's logprob under the target (the first has none) plus top-N. Such a request
    # computes its whole prompt (no prefix-cache reads): the cache holds K/V, not the logits these need.
    prompt_logprobs: int | None = None
    num_speculative_tokens: int | None = None
    constraint: Constraint | None = None  # the output must match it (engine.structured)
    token_healing: bool = False  # back off the prompt's last token and re-generate it (engine.structured.healing)

    def __post_init__(self) -> None:
        # Accept lists for convenience; store tuples so nothing shared can be mutated afterwards.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        # 0: the prompt alone is computed (scoring it, with prompt_logprobs), nothing is sampled.
        _check(self.max_tokens >= 0, "max_tokens", f"must be >= 0, got {self.max_tokens}")
        _check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias.items():
            _check(token >= 0, "logit_bias", f"token id {token} is negative")
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"bias {bias} for token {token} not in [-100, 100]")
        if self.seed is not None:
            lo, hi = SEED_RANGE
            _check(lo <= self.seed <= hi, "seed", f"must be in [-2**63, 2**64 - 1], got {self.seed}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
        )
        if self.constraint is not None:
            # The grammar decides where the output ends; a floor on its length could contradict it.
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured output")
            # Composing the healed text with the request's grammar would need a grammar for "the rest of a
            # token, then the user's grammar", which no constraint kind expresses: refused, not half-done.
            _check(not self.token_healing, "token_healing", "cannot be combined with structured output")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check(0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
                   f"must be in [0, 20], got {self.prompt_logprobs}")
            _check(not self.token_healing, "prompt_logprobs", "cannot be combined with token_healing (it re-spells "
                   "the prompt's end)")
        if self.num_speculative_tokens is not None:
            _check(
                0 <= self.num_speculative_tokens <= 16,
                "num_speculative_tokens",
                f"must be in [0, 16], got {self.num_speculative_tokens}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncates(self) -> bool:
        """Whether top-k/top-p/min-p change the distribution (needs the sorting path)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)
