"""Stop conditions and incremental detokenization, with a real (tiny, byte-level BPE) tokenizer."""

from __future__ import annotations

import pytest

from engine.sched.stop import StopChecker
from engine.types.detokenizer import IncrementalDetokenizer, find_stop, held_back
from engine.types.sampling_params import SamplingParams
from engine.types.sequence import FinishReason, Sequence, SequenceStatus
from tests.tiny_models import EOS, build_tokenizer

PROMPT = "def fib(n):\n    "
TEXT = "return fib(n - 1)"  # r|et|urn| fib|(|n| -| |1|)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def start(tok, max_model_len=1000, prompt=PROMPT, **params):
    checker = StopChecker((EOS,), max_model_len, tok)
    seq = Sequence(request_id="r", token_ids=tok.encode(prompt), params=SamplingParams(**params))
    checker.start(seq)
    return checker, seq


def feed(checker, seq, tokens):
    """Append tokens one at a time, as the engine does. Returns (reasons, deltas) for the tokens kept."""
    reasons, deltas = [], []
    for t in tokens:
        seq.token_ids.append(t)
        reason = checker.check(seq, t)
        if reason is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
        reasons.append(reason)
        deltas.append(checker.release(seq))
        if reason is not None:
            break
    return reasons, deltas


def test_tokenizer_splits_the_sample_text_as_the_tests_assume(tok):
    assert [tok.decode([i]) for i in tok.encode(TEXT)] == ["r", "et", "urn", " fib", "(", "n", " -", " ", "1", ")"]


# ---- stop strings -------------------------------------------------------------------------------


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tok):
    checker, seq = start(tok, stop=["b(n"])
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons[-1] is FinishReason.STOP
    assert seq.stop_reason == "b(n"
    assert len(reasons) == 6  # ended by the token "n" that completed the stop string
    # " fib" ends in "b", which may start the stop string: it is held back, then dropped with the stop.
    assert deltas == ["r", "et", "urn", " fi", "", ""]
    assert "".join(deltas) == "return fi"


def test_partial_stop_prefix_is_held_back_then_released_when_it_diverges(tok):
    checker, seq = start(tok, stop=["b(x"], max_tokens=10)
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert deltas == ["r", "et", "urn", " fi", "", "b(n", " -", " ", "1", ")"]
    assert reasons[-1] is FinishReason.LENGTH
    assert reasons[:-1] == [None] * 9
    assert "".join(deltas) == TEXT
    assert seq.stop_reason is None


def test_held_back_tail_is_flushed_when_the_sequence_ends_for_another_reason(tok):
    checker, seq = start(tok, stop=["b(x"], max_tokens=5)  # ends on "(" while "b(" is held back
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons[-1] is FinishReason.LENGTH
    assert deltas == ["r", "et", "urn", " fi", "b("]


def test_stop_string_inside_a_single_token_cuts_the_token_text(tok):
    checker, seq = start(tok, stop=["ib"])
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons[-1] is FinishReason.STOP and len(reasons) == 4
    assert "".join(deltas) == "return f"
    assert seq.stop_reason == "ib"


def test_earliest_of_several_stop_strings_wins(tok):
    checker, seq = start(tok, stop=["ib(", "f", "zzz"])
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons[-1] is FinishReason.STOP and len(reasons) == 4
    assert seq.stop_reason == "f"
    assert "".join(deltas) == "return "


def test_stop_string_made_of_a_multibyte_character(tok):
    text = "héllo wörld ✓ done"
    checker, seq = start(tok, stop=["✓"], max_tokens=100)
    reasons, deltas = feed(checker, seq, tok.encode(text))
    assert reasons[-1] is FinishReason.STOP
    assert "".join(deltas) == "héllo wörld "
    assert all("\ufffd" not in d for d in deltas)


def test_min_tokens_defers_stop_strings(tok):
    # "et" is complete after the 2nd token, but min_tokens=3 forbids ending there; the later " -"
    # (after the 3rd token) ends it.
    checker, seq = start(tok, stop=["et", " -"], min_tokens=3)
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons[-1] is FinishReason.STOP
    assert seq.stop_reason == " -"
    assert "".join(deltas) == "return fib(n"


def test_a_short_stop_string_suppressed_by_min_tokens_does_not_fire_later_beside_a_long_one(tok):
    # "et" completes at the 2nd token, while min_tokens suppresses stops. The long stop string's window
    # reaches back over it at every later token; only stops ending in the new text may fire.
    checker, seq = start(tok, stop=["et", "@@@@ long stop @@@@"], min_tokens=3)
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert set(reasons) == {None} and seq.stop_reason is None
    assert "".join(deltas) == TEXT


def test_find_stop_gives_each_stop_string_its_own_window():
    assert find_stop("xxYYabc", ("YY", "@@@@ long @@@@"), 1) is None  # "YY" ended before the new "c"
    assert find_stop("xxYYabc", ("YY", "abc"), 1) == (4, "abc")


def test_held_back_counts_the_longest_stop_prefix_at_the_end():
    assert held_back("abc", ("cd",)) == 1
    assert held_back("abc", ("bcd", "cd")) == 2
    assert held_back("abc", ("xyz",)) == 0
    assert held_back("ab", ("abc",)) == 2
    assert held_back("a", ("abcdef",)) == 1
    assert held_back("", ("abc",)) == 0


def test_find_stop_only_reports_stops_ending_in_the_new_characters():
    assert find_stop("hello world", ("wor",), 3) == (6, "wor")
    assert find_stop("hello world", ("lo", "wor"), 5) == (6, "wor")  # "lo" ended before the new text
    assert find_stop("hello world", ("lo w",), 5) == (3, "lo w")  # spans old and new text
    assert find_stop("hello world", ("xyz",), 11) is None


# ---- EOS, stop token ids, lengths ---------------------------------------------------------------


def test_eos_stops_and_its_text_is_not_emitted(tok):
    checker, seq = start(tok)
    reasons, deltas = feed(checker, seq, [*tok.encode("return"), EOS, *tok.encode(" x")])
    assert reasons[-1] is FinishReason.STOP
    assert len(reasons) == 4
    assert seq.stop_reason is None
    assert "".join(deltas) == "return"


def test_ignore_eos_generates_through_eos(tok):
    checker, seq = start(tok, ignore_eos=True, max_tokens=4)
    reasons, deltas = feed(checker, seq, [*tok.encode("ret"), EOS, *tok.encode("urn")])  # r|et|EOS|urn
    assert reasons == [None, None, None, FinishReason.LENGTH]
    assert "".join(deltas) == "return"  # the special token has no text


def test_stop_token_id_stops_and_is_reported(tok):
    et = tok.encode("et")
    assert len(et) == 1
    checker, seq = start(tok, stop_token_ids=et)
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons == [None, FinishReason.STOP]
    assert seq.stop_reason == et[0]
    assert "".join(deltas) == "r"


def test_stop_token_ids_apply_even_with_ignore_eos(tok):
    checker, seq = start(tok, ignore_eos=True, stop_token_ids=[EOS])
    reasons, _ = feed(checker, seq, [*tok.encode("ret"), EOS])
    assert reasons[-1] is FinishReason.STOP
    assert seq.stop_reason == EOS


@pytest.mark.parametrize("stopper", ["eos", "stop_token_id"])
def test_min_tokens_suppresses_eos_and_stop_token_ids_until_enough_tokens(tok, stopper):
    extra = {"stop_token_ids": [7]} if stopper == "stop_token_id" else {}
    token = 7 if stopper == "stop_token_id" else EOS
    checker, seq = start(tok, min_tokens=2, **extra)
    reasons, _ = feed(checker, seq, [token, token, token, token])
    # Two tokens must be generated first; the third may end the sequence.
    assert reasons == [None, None, FinishReason.STOP]


def test_max_tokens_gives_length_on_the_last_allowed_token(tok):
    checker, seq = start(tok, max_tokens=3)
    reasons, deltas = feed(checker, seq, tok.encode(TEXT))
    assert reasons == [None, None, FinishReason.LENGTH]
    assert "".join(deltas) == "return"


def test_context_limit_gives_length(tok):
    n = len(tok.encode(PROMPT))
    checker, seq = start(tok, max_model_len=n + 2, max_tokens=100)
    reasons, _ = feed(checker, seq, tok.encode(TEXT))
    assert reasons == [None, FinishReason.LENGTH]
    assert seq.num_tokens == n + 2


def test_eos_on_the_last_allowed_token_is_a_stop_not_length(tok):
    checker, seq = start(tok, max_tokens=2)
    reasons, _ = feed(checker, seq, [tok.encode("r")[0], EOS])
    assert reasons == [None, FinishReason.STOP]


def test_checker_without_tokenizer_still_handles_eos_and_length():
    checker = StopChecker((EOS,), 1000, None)
    a = Sequence("a", [5, 6, 7], SamplingParams(max_tokens=3))
    b = Sequence("b", [5, 6, 7], SamplingParams(max_tokens=3))
    checker.start(a)
    checker.start(b)
    assert feed(checker, a, [9, 9, 9, 9]) == ([None, None, FinishReason.LENGTH], ["", "", ""])
    assert feed(checker, b, [9, EOS, 9])[0] == [None, FinishReason.STOP]


# ---- incremental detokenization -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["héllo wörld ✓", "x 😀 y", "✓✓ é😀é", "import os\nprint(os.path.join('a', 'b'))\n# ünïcode ✓\n"],
)
def test_incremental_detokenizer_never_splits_a_multibyte_character(tok, text):
    ids = tok.encode(text)
    # The scenario is real: some character's bytes are spread over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas = [detok.add(i) for i in ids]
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # whole characters only
    assert "".join(deltas) == tok.decode(ids) == text


def test_incremental_detokenizer_keeps_leading_spaces_after_the_prompt(tok):
    prompt = tok.encode("def")
    ids = tok.encode(" fib(n - 1)")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == " fib(n - 1)"
    assert deltas[0] == " fib"


def test_incremental_detokenizer_on_a_long_stream_matches_a_full_decode(tok):
    text = "class Point:\n    def __init__(self, x, y):\n        self.x = x  # ✓ é 😀\n" * 3
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [1])
    out = "".join(detok.add(i) for i in ids)
    assert out == tok.decode(ids) == text



def metaspace_tokenizer(out):
    """A sentencepiece-like tokenizer (Metaspace word starts, byte fallback): Llama's decoding, not GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>",
                                                                                               *bytes_],
                                                             show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.clean_up_tokenization_spaces = False
    return fast


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_the_rust_decode_stream_gives_the_windowed_decodes_deltas(tok, tmp_path, kind):
    """The fast path (tokenizers' DecodeStream) against the windowed Python decodes it replaces, token by token,
    on random ids with special tokens and lone bytes among them, and on text with multi-byte characters."""
    import random

    t = tok if kind == "byte-level" else metaspace_tokenizer(tmp_path)
    rng = random.Random(kind)
    streams = [t.encode("héllo wörld ✓ 😀 敼本書 def f(x):\n    return x")]
    streams += [[rng.randrange(len(t)) for _ in range(200)] for _ in range(20)]
    for ids in streams:
        prompt = t.encode("def fib(n):")
        fast, slow = IncrementalDetokenizer(t, prompt), IncrementalDetokenizer(t, prompt)
        assert fast._stream is not None
        slow._stream = None
        assert [fast.add(i) for i in ids] == [slow.add(i) for i in ids]
        assert fast.flush() == slow.flush()


def test_stop_checker_deltas_never_split_multibyte_characters(tok):
    text = "héllo wörld ✓ 😀 end"
    checker, seq = start(tok, stop=["zzz"], max_tokens=len(tok.encode(text)))
    reasons, deltas = feed(checker, seq, tok.encode(text))
    assert reasons[-1] is FinishReason.LENGTH
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


# ---- the end of the text ------------------------------------------------------------------------


def partial_character_ids(tok) -> list[int]:
    """Tokens for two whole CJK characters, then the first byte of a third: no clean end."""
    whole, third = tok.encode("敼本"), tok.encode("書")
    assert tok.decode(third[:1]).endswith("\ufffd"), "the third character must start with a byte token of its own"
    return whole + third[:1]


@pytest.mark.parametrize("reason", ["length", "eos"])
def test_a_finish_inside_an_incomplete_character_flushes_what_the_tokenizer_renders(tok, reason):
    ids = partial_character_ids(tok)
    tail = [EOS] if reason == "eos" else []
    checker, seq = start(tok, max_tokens=len(ids) + len(tail))
    reasons, deltas = feed(checker, seq, ids + tail)
    assert reasons[-1] is (FinishReason.LENGTH if reason == "length" else FinishReason.STOP)
    text = "".join(deltas)
    assert text == tok.decode(ids) and text.startswith("敼本"), "complete characters are never lost"
