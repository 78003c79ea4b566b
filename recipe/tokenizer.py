"""Byte-level BPE trained with `tokenizers`, saved so that transformers' AutoTokenizer loads it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
# The pair writes code, not dialogue: a chat renders as the messages' text joined by newlines, and the assistant
# continues the last message on its own line. No newline at the end: this BPE merges a newline with the next
# line's indentation, so a prompt ending in a bare newline token tells the model the next line has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ message['content'] }}{% endfor %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # No prefix space: code starts at column 0, and a space there would change indentation.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=model_max_length
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_byte_lengths(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Bytes each token id stands for: byte-level BPE spells one byte per character; special tokens are 0."""
    special = set(tokenizer.all_special_ids)
    lengths = [0] * len(tokenizer)
    for token, idx in tokenizer.get_vocab().items():
        lengths[idx] = 0 if idx in special else len(token)
    return lengths


def save(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
