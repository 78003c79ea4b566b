"""benchmarks/controller_ab.py: a conversation's turns, each built from the output before it, and its
--controller settings."""

from __future__ import annotations

import argparse

import pytest


def test_a_conversation_sends_each_turn_built_from_the_output_of_the_one_before(model_sets):
    from benchmarks.controller_ab import run
    from benchmarks.peer_bench.workload import Conversation
    from engine import LLM

    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), dtype="float32", device="cpu", speculative_method="none")
    sent: list[str] = []
    prepare = llm.engine.prepare

    def spy(prompt, params):  # noqa: ANN001, ANN202
        sent.append(prompt)
        return prepare(prompt, params)

    llm.engine.prepare = spy
    decode = llm.engine.tokenizer.decode
    conversation = Conversation("def f(x):", turns=3, follow_up="\n# again\n")
    _, emitted, outputs = run(llm, [conversation, "x = 1"], 2, decode)
    assert [len(turns) for turns in outputs] == [3, 1], "every turn of the conversation, one for the prompt"
    turns = [p for p in sent if p.startswith("def f(x):")]
    assert turns[0] == "def f(x):"
    for before, after, output in zip(turns, turns[1:], outputs[0]):
        assert after == before + decode(output) + "\n# again\n"
    assert emitted == sum(len(ids) for turns in outputs for ids in turns)


def test_a_controller_setting_is_a_name_and_a_number():
    from benchmarks.controller_ab import setting

    assert setting("probe_interval=16") == ("probe_interval", 16.0)
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        setting("probe_interval")
