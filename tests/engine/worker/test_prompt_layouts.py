"""Prompt graphs (engine.worker.prompt_layouts): compiled ahead of time into a file of their own, loaded beside the
decode graphs (precompile.add_prompts), run for one prompt chunk a forward with the eager forward's logits; a
forward of a prompt no graph fits, or of two short prompts, runs eagerly and is not counted as an uncompiled
decode; prompts beside short queries that no graph serves whole, and prompts alone two of which are past
SMALL_ROWS, run in parts (ModelRunner._in_parts), logits unchanged; and where a model serves decode graphs with no
prompt file current, they are compiled and added to the graphs it serves (engine.worker.prompt_compile)."""

from __future__ import annotations

import logging
import pickle
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.layers import small_linear
from engine.layers.attention_metadata import SHORT_QUERY
from engine.worker import aot_graphs, precompile, prompt_compile
from engine.worker.forward_batch import ForwardBatch
from engine.worker.graph_files import prompt_artifact
from engine.worker.model_runner import ModelRunner
from engine.worker.prompt_compile import PromptCompile
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


@pytest.fixture(scope="module")
def prompt_file(model_dir, tmp_path_factory):
    """Four of the layouts compiled, to keep the compile short: the first (its sizes static), a fresh prompt beside
    two decoders, one after a cached prefix, and a fresh one past SMALL_ROWS."""
    source = ModelRunner.load(str(model_dir), "float32", "cpu")
    source.allocate_cache(3 * prompt_blocks(K, BLOCK), BLOCK)
    small_linear.install(source.model, KEYS)
    every_layout = prompt_layouts(K, BLOCK, 3 * prompt_blocks(K, BLOCK))
    chosen = [*every_layout[:4], every_layout[5]]
    del chosen[1]
    every = aot_graphs.warm_up_layouts
    aot_graphs.warm_up_layouts = lambda *args: chosen
    try:
        data = aot_graphs.compile_runner(source, K)
    finally:
        aot_graphs.warm_up_layouts = every
    path = tmp_path_factory.mktemp("prompt-file") / "prompts.bin"
    path.write_bytes(data)
    return path


def test_a_prompt_beside_decoders_runs_its_graph_and_a_mix_no_graph_fits_runs_in_parts_with_the_eager_logits(
        model_dir, prompt_file):
    runner = ModelRunner.load(str(model_dir), "float32", "cpu", compile=True)
    runner.allocate_cache(64, BLOCK)
    graphs = aot_graphs.Precompiled(runner, pickle.dumps({"sources": [], "graphs": []}))  # no decode graph
    precompile.add_prompts(runner, graphs, KEYS, prompt_file)
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


def test_prompt_graphs_missing_beside_served_decode_graphs_are_compiled_once_then_serve_prompt_chunks(
        model_dir, prompt_file, tmp_path, monkeypatch, caplog):
    """The child's compile is the module's file here (its own: the test above and precompile.main); what is shown
    is when it is asked for, and that a prompt chunk served eagerly before runs its graph after, logits unchanged."""
    caplog.set_level(logging.INFO, logger="engine")
    runner = ModelRunner.load(str(model_dir), "float32", "cpu", compile=True)
    runner.allocate_cache(64, BLOCK)
    graphs = aot_graphs.Precompiled(runner, pickle.dumps({"sources": [], "graphs": []}))  # its decode graphs
    runner.compiled.precompiled = graphs
    on_disk = tmp_path / "prompts.bin"
    monkeypatch.setattr(prompt_compile, "prompt_artifact", lambda r, k: on_disk)
    monkeypatch.setattr(prompt_compile, "artifact", lambda r, k: tmp_path / f"{KEYS}.bin")  # the decode file
    asked: list[tuple[list[str], int]] = []

    def child(runners, k_max, dtype, trust_remote_code):  # noqa: ANN001, ANN202
        asked.append(([r.name for r in runners], k_max))
        shutil.copy(prompt_file, on_disk)

    monkeypatch.setattr(precompile, "compile_prompts", child)
    gen = torch.Generator().manual_seed(1)
    batch = ForwardBatch([torch.randint(V, (SHORT - 20,), generator=gen).tolist()], [CONTEXT + 4],
                         [list(range(48, 64))], [1])  # after a cached prefix
    eager = runner.forward(batch)
    assert (runner.compiled.prompt_compiled, runner.compiled.prompt_eager) == (0, 1)

    # After a background compile: started on the stepping thread once the compile's queued jobs are, not before.
    class Background:
        def __init__(self) -> None:
            self.jobs: list = []

        def then(self, job):  # noqa: ANN001, ANN202
            self.jobs.append(job)

    background, between, done = Background(), [], []
    job = PromptCompile([runner], K, "float32", False)
    job.then(lambda: done.append(job.added))  # the engine's: settle the heap with the new graphs in it
    assert job.missing() == [runner]
    job.start_after(background, between.append)
    assert job.thread.ident is None and not between
    background.jobs[0]()
    assert job.thread.ident is None and len(between) == 1, "handed to the stepping thread"
    between[0]()
    job.thread.join(timeout=60)
    assert asked == [([runner.name], K)] and job.added == 4 == len(graphs)
    assert done == [4], "its jobs run once, after the graphs are added"
    out = runner.forward(batch)
    assert (runner.compiled.prompt_compiled, runner.compiled.prompt_eager) == (1, 1), "its graph ran"
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)

    # Current on disk (a later start had loaded it with the decode graphs): nothing asked, nothing added twice.
    again = PromptCompile([runner], K, "float32", False)
    again.then(lambda: done.append("again"))
    again.start_after(None, between.append)
    again.thread.join(timeout=60)
    assert again.missing() == [] and len(asked) == 1 and len(graphs) == 4

    # A child that fails leaves the prompt chunks eager, the server serving.
    def failing(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("compiling the prompt graphs failed: exit code 1: no compiler here")

    monkeypatch.setattr(precompile, "compile_prompts", failing)
    monkeypatch.setattr(prompt_compile, "prompt_artifact", lambda r, k: tmp_path / "other.bin")
    failed = PromptCompile([runner], K, "float32", False)
    failed.then(lambda: done.append("failed"))
    failed.start()
    failed.thread.join(timeout=60)
    assert failed.added == 0 and len(graphs) == 4 and "no compiler here; prompt chunks stay eager" in caplog.text
    assert done == [4], "nothing added: no job runs"
