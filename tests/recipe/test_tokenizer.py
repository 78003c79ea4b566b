from __future__ import annotations

from transformers import AutoTokenizer

from recipe.tokenizer import EOS, save, token_byte_lengths, train_bpe

TEXTS = [
    "def area(r):\n    return 3.14159 * r * r\n",
    "class Box:\n    def __init__(self, w, h):\n        self.w, self.h = w, h\n",
    "# café ünïcode ✓\nprint('naïve')\n",
] * 20


def test_trained_tokenizer_loads_with_autotokenizer_and_round_trips_code_exactly(tmp_path):
    save(train_bpe(TEXTS, vocab_size=400, model_max_length=512), tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == EOS and tok.eos_token_id is not None
    assert tok.model_max_length == 512
    text = "    if x:\n\t\treturn 'é✓'  \n"  # indentation, tabs, trailing spaces, multi-byte characters
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_token_byte_lengths_sum_to_the_utf8_length(tmp_path):
    tok = train_bpe(TEXTS, vocab_size=400, model_max_length=512)
    lengths = token_byte_lengths(tok)
    for text in TEXTS[:3]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert sum(lengths[i] for i in ids) == len(text.encode())
    assert lengths[tok.eos_token_id] == 0


def test_chat_template_renders_messages_as_text_for_the_model_to_continue(tmp_path):
    save(train_bpe(TEXTS, vocab_size=400, model_max_length=512), tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "# utilities"}, {"role": "user", "content": "def add(a, b):"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "# utilities\ndef add(a, b):"
