"""Stop conditions, checked token by token as verified tokens are appended."""

from __future__ import annotations

from typing import Any

from engine.types.detokenizer import IncrementalDetokenizer, find_stop, held_back
from engine.types.sequence import FinishReason, Sequence


class StopChecker:
    """EOS (unless ignore_eos), stop token ids, stop strings (matched across token boundaries and
    never emitted), max_tokens and the context limit. Tokens accepted after a stop are discarded,
    exactly as the target alone would never have produced them. The text state it keeps lives on
    each sequence (``seq.text``)."""

    def __init__(self, eos_ids: tuple[int, ...], max_model_len: int, tokenizer: Any | None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.text.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids)

    def check(self, seq: Sequence, token: int) -> FinishReason | None:
        """Call after appending ``token``; updates the text and may set ``seq.stop_reason``."""
        p, st = seq.params, seq.text
        may_stop = seq.num_output_tokens > p.min_tokens  # the same rule that bans EOS in the logits
        if may_stop and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            # The stop token's own text is not part of the output; what was pending before it is.
            st.add(st.detok.flush() if st.detok is not None else "")
            seq.stop_reason = None if token in self.eos_ids and not p.ignore_eos else token
            return FinishReason.STOP
        delta = st.add(st.detok.add(token) if st.detok is not None else "")
        if may_stop and p.stop and delta:
            hit = find_stop(st.text, p.stop, len(delta))
            if hit is not None:
                st.text = st.text[: hit[0]]
                seq.stop_reason = hit[1]
                return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.finished:
            # The grammar allows nothing but the end: the masked target's next token would be EOS.
            st.add(st.detok.flush() if st.detok is not None else "")
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            st.add(st.detok.flush() if st.detok is not None else "")
            return FinishReason.LENGTH
        return None

    def release(self, seq: Sequence) -> str:
        """New text safe to show: all of it once finished, else minus a tail that may become a stop string."""
        st = seq.text
        end = len(st.text)
        if not seq.is_finished and seq.params.stop:
            end -= held_back(st.text, seq.params.stop)
        end = max(end, st.released)
        out = st.text[st.released : end]
        st.released = end
        return out
