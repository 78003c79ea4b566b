"""Engine configuration: frozen, validated at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SpeculativeMethod(enum.Enum):
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"
    NONE = "none"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft_model: str | None = None
    speculative_method: SpeculativeMethod = SpeculativeMethod.NONE
    # None = adaptive: choose k per sequence per step from acceptance and measured costs.
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 8  # upper bound of the adaptive search
    ngram_max: int = 4  # n-gram lookup tries n = ngram_max .. ngram_min
    ngram_min: int = 1
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None = the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    seed: int = 0
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative_method, str):
            try:
                object.__setattr__(self, "speculative_method", SpeculativeMethod(self.speculative_method))
            except ValueError:
                valid = ", ".join(m.value for m in SpeculativeMethod)
                raise ValueError(
                    f"speculative_method must be one of {valid}, got {self.speculative_method!r}"
                ) from None
        if self.speculative_method is SpeculativeMethod.DRAFT_MODEL and not self.draft_model:
            raise ValueError("speculative_method='draft_model' needs draft_model")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.max_speculative_tokens <= 16:
            raise ValueError(f"max_speculative_tokens must be in [1, 16], got {self.max_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def speculates(self) -> bool:
        return self.speculative_method is not SpeculativeMethod.NONE and self.num_speculative_tokens != 0

    @property
    def k_max(self) -> int:
        """The most drafts any sequence may get in one step."""
        if not self.speculates:
            return 0
        return self.num_speculative_tokens if self.num_speculative_tokens is not None else self.max_speculative_tokens
