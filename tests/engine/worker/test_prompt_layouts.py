"""Prompt graphs (engine.worker.prompt_layouts): compiled ahead of time into a file of their own, loaded beside the
decode graphs (precompile.add_prompts), run for one prompt chunk a forward with the eager forward's logits; a
forward of a prompt no graph fits, or of two short prompts, runs eagerly and is not counted as an uncompiled
decode; prompts beside short queries that no graph serves whole, and prompts alone two of which are past
SMALL_ROWS, run in parts (ModelRunner._in_parts), logits unchanged."""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.layers import small_linear
from engine.layers.attention_metadata import SHORT_QUERY
from engine.worker import aot_graphs, precompile
from engine.worker.forward_batch import ForwardBatch
from engine.worker.graph_files import prompt_artifact
from engine.worker.model_runner import ModelRunner
from engine.worker.prompt_layouts import CONTEXT, SHORT, prompt_blocks, prompt_layouts

K, BLOCK, V = 3, 16, 64
KEYS = "prompt-graphs-under-test"  # the packed layers' keys, as a decode file's stem would name them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    out = tmp_path_factory.mktemp("prompt-graphs") / "target"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def test_the_layouts_fit_the_blocks_they_claim_and_each_has_one_prompt():
    for k in (1, 8, SHORT_QUERY - 1):  # a verify of k_max drafts stays a short query
        for batch in prompt_layouts(k, BLOCK, 3 * prompt_blocks(k, BLOCK), 2 * prompt_blocks(k, BLOCK)):
            ends = [s + len(t) for s, t in zip(batch.starts, batch.token_ids)]
            assert sum(len(t) > SHORT_QUERY for t in batch.token_ids) == 1
            assert all(-(-e // BLOCK) <= len(table) for e, table in zip(ends, batch.block_tables))


def test_a_prompt_beside_decoders_runs_its_graph_and_a_mix_no_graph_fits_runs_in_parts_with_the_eager_logits(
        model_dir, tmp_path):
    source = ModelRunner.load(str(model_dir), "float32", "cpu")
    source.allocate_cache(3 * prompt_blocks(K, BLOCK), BLOCK)
    small_linear.install(source.model, KEYS)
    # Four of the layouts, to keep the compile short: the first (its sizes static), a fresh prompt beside two
    # decoders, one after a cached prefix, and a fresh one past SMALL_ROWS.
    every_layout = prompt_layouts(K, BLOCK, 3 * prompt_blocks(K, BLOCK))
    chosen = [*every_layout[:4], every_layout[5]]
    del chosen[1]
    every = aot_graphs.warm_up_layouts
    aot_graphs.warm_up_layouts = lambda *args: chosen
    try:
        data = aot_graphs.compile_runner(source, K)
    finally:
        aot_graphs.warm_up_layouts = every
    path = tmp_path / "prompts.bin"
    path.write_bytes(data)

    runner = ModelRunner.load(str(model_dir), "float32", "cpu", compile=True)
    runner.allocate_cache(64, BLOCK)
    graphs = aot_graphs.Precompiled(runner, pickle.dumps({"sources": [], "graphs": []}))  # no decode graph
    precompile.add_prompts(runner, graphs, KEYS, path)
    assert len(graphs) == 4, "every chosen layout compiled"
    compiled = runner.compiled
    compiled.precompiled = graphs
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(V, (n,), generator=gen).tolist()

    one, other, prompt, cached = (list(range(16 * i, 16 * i + 16)) for i in range(4))
    for table in (one, other, cached):  # contexts to read: prompts alone, which no graph here fits
        runner.forward(ForwardBatch([tokens(CONTEXT + 4)], [0], [table], [1]))
    assert (compiled.calls, compiled.uncompiled) == (0, 0), "eager, and not an uncompiled decode"
    assert (compiled.prompt_compiled, compiled.prompt_eager) == (0, 3), "counted as eager prompt forwards"

    def compiled_and_eager(batch: ForwardBatch) -> None:
        calls, served = compiled.calls, compiled.prompt_compiled
        out = runner.forward(batch)
        assert compiled.calls == calls + 1 and compiled.prompt_compiled == served + 1, "its graph ran"
        compiled.precompiled = None
        try:
            eager = runner.forward(batch)  # writes the same K/V again
        finally:
            compiled.precompiled = graphs
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)

    # Other sizes than the traced ones: one graph serves every length within small_linear.SMALL_ROWS rows.
    compiled_and_eager(ForwardBatch([tokens(1), tokens(1), tokens(SHORT - 7)], [CONTEXT + 3, CONTEXT // 2, 0],
                                    [one, other, prompt], [1, 1, 1]))
    compiled_and_eager(ForwardBatch([tokens(SHORT - 20)], [CONTEXT + 4], [cached], [1]))
    calls, eager = compiled.calls, compiled.prompt_eager
    runner.forward(ForwardBatch([tokens(50), tokens(60)], [0, 0], [prompt, one], [1, 1]))
    assert (compiled.calls, compiled.uncompiled) == (calls, 0), "two short prompts: eager, not an uncompiled decode"
    assert compiled.prompt_eager == eager + 1

    # Prompts alone, two past SMALL_ROWS: each of those in its graph, the shorter one in its own. The second needs
    # no logits (a chunk before its prompt's last): its graph keeps one row, dropped.
    long = small_linear.SMALL_ROWS + 9
    batch = ForwardBatch([tokens(long), tokens(long + 13), tokens(SHORT - 20)], [0, 0, CONTEXT + 4],
                         [one, other, cached], [1, 0, 1])
    assert batch.apart() == [[0], [1], [2]]
    calls, served, eager = compiled.calls, compiled.prompt_compiled, compiled.prompt_eager
    out = runner.forward(batch)
    assert (compiled.calls, compiled.prompt_compiled, compiled.prompt_eager) == (calls + 3, served + 3, eager)
    compiled.precompiled = None
    try:
        whole = runner.forward(batch)
    finally:
        compiled.precompiled = graphs
    assert out.shape == (2, V)
    torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-4)
    served = compiled.prompt_compiled
    assert runner.forward(ForwardBatch([tokens(long)], [0], [one], [0])).shape == (0, V)
    assert compiled.prompt_compiled == served + 1, "a lone chunk that needs no logits ran its graph too"

    def in_parts(batch: ForwardBatch, prompts: int) -> None:
        served, eager, uncompiled = compiled.prompt_compiled, compiled.prompt_eager, compiled.uncompiled
        out = runner.forward(batch)
        assert compiled.prompt_compiled == served + prompts, "each prompt chunk ran its graph, alone"
        assert compiled.prompt_eager == eager, "no forward of the whole ran eagerly"
        assert compiled.uncompiled == uncompiled + 1, "the short queries ran as a forward of their own"
        compiled.precompiled = None
        try:
            whole = runner.forward(batch)  # eager, in one forward: the logits rows in the same order
        finally:
            compiled.precompiled = graphs
        torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-4)

    # Beside short queries (here no decode graph: they run eagerly), two prompts after cached prefixes, each ran
    # apart in the graph of one; and one prompt beside sequences feeding unequal numbers of tokens, a mix no chosen
    # graph fits whole.
    in_parts(ForwardBatch([tokens(1), tokens(SHORT - 20), tokens(2), tokens(SHORT - 25)],
                          [CONTEXT + 4, CONTEXT + 4, 10, CONTEXT + 4], [one, cached, prompt, other], [1, 1, 2, 1]), 2)
    in_parts(ForwardBatch([tokens(3), tokens(1), tokens(SHORT - 30)], [CONTEXT + 5, 12, CONTEXT + 4],
                          [one, prompt, cached], [3, 1, 1]), 1)


def test_the_prompt_file_is_keyed_by_its_decode_file_and_the_prompt_layouts(model_dir, monkeypatch):
    runner = ModelRunner.load(str(model_dir), "float32", "cpu")
    runner.allocate_cache(4, BLOCK)
    prompts, decode = prompt_artifact(runner, K), precompile.artifact(runner, K)
    assert prompts.parent == decode.parent and prompts.name.startswith(decode.stem) and prompts != decode
    assert prompt_artifact(runner, K + 1).name.startswith(precompile.artifact(runner, K + 1).stem)
