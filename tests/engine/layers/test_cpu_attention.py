"""The CPU attention kernel (engine/layers/kernels/paged_attention.cpp): each query row attends exactly to its own
sequence's keys up to its position, read through the slot table, over one chunk of keys or several; a row's result
does not depend on the batch around it or on the thread count; compiled callers keep it in their graph; the model
runner sends short queries through it, a lone sequence's contiguous span included."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from engine.layers import cpu_attention
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

SLOTS = 2048
CHUNK = 32  # the kernel's keys per task (CHUNK in paged_attention.cpp)


def _case(rng: random.Random, G: int, Q: int, H: int, Hkv: int, D: int, longest: int = 50) -> dict:
    """G sequences with contexts of their own (some shorter than C, so past-the-end slots are padding) and up to
    Q queries each at the context's last positions; missing queries are padding rows at position 0."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ends = [rng.randint(Q, longest) for _ in range(G)]
    C = max(ends)
    free = rng.sample(range(SLOTS), G * C)  # scattered, distinct slots
    slots = torch.tensor(free).view(G, C)
    positions = torch.zeros(G, Q, dtype=torch.long)
    for i, e in enumerate(ends):
        q = rng.randint(1, Q)
        positions[i, :q] = torch.arange(e - q, e)
    return {
        "q": torch.randn(G, Q, H, D, generator=g),
        "k_cache": torch.randn(SLOTS, Hkv, D, generator=g),
        "v_cache": torch.randn(SLOTS, Hkv, D, generator=g),
        "slots": slots,
        "positions": positions,
        "scale": D**-0.5,
    }


def _reference(q, k_cache, v_cache, slots, positions, scale) -> torch.Tensor:
    """Row by row in float64: softmax over keys [0, position] of this sequence, through its slots."""
    G, Q, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.empty(G, Q, H, D, dtype=torch.float64)
    for g in range(G):
        for i in range(Q):
            idx = slots[g, : positions[g, i] + 1]
            for h in range(H):
                k = k_cache[idx, h // group].double()  # [n, D]
                v = v_cache[idx, h // group].double()
                p = torch.softmax(k @ q[g, i, h].double() * scale, dim=0)
                out[g, i, h] = p @ v
    return out


@pytest.mark.parametrize(("H", "Hkv", "D"), [(6, 6, 64), (8, 2, 32), (4, 1, 128), (4, 2, 48)])
def test_each_row_attends_to_its_own_sequences_keys_up_to_its_position(H, Hkv, D):
    """Heads sharing a KV head (GQA), the specialised head sizes and a generic one (48)."""
    rng = random.Random(D * 100 + H)
    for G, Q in [(1, 1), (5, 1), (3, 4), (7, 6)]:
        case = _case(rng, G, Q, H, Hkv, D)
        got = cpu_attention.paged_attention(**case)
        torch.testing.assert_close(got.double(), _reference(**case), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("G", "Q"), [(1, 1), (1, 5), (2, 3), (9, 2)])
def test_contexts_of_several_chunks_merge_to_the_whole_softmax(G, Q):
    """Contexts up to 7 chunks long, queries straddling a chunk's edge, one task per KV head (few chunks in all)
    or per chunk (many)."""
    rng = random.Random(G * 10 + Q)
    case = _case(rng, G, Q, 6, 3, 64, longest=7 * CHUNK)
    case["positions"][0, :Q] = torch.arange(CHUNK - Q // 2, CHUNK - Q // 2 + Q)
    torch.testing.assert_close(cpu_attention.paged_attention(**case).double(), _reference(**case), atol=2e-5,
                               rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_thread_count():
    case = _case(random.Random(4), 3, 4, 6, 6, 64, longest=5 * CHUNK)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_attention.paged_attention(**case))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def test_a_rows_result_does_not_depend_on_the_batch_around_it():
    """Bit for bit: a sequence's rows alone, or among others with longer contexts and more queries."""
    case = _case(random.Random(1), 6, 5, 8, 4, 64, longest=4 * CHUNK)
    batch = cpu_attention.paged_attention(**case)
    for g in range(6):
        n = int(case["positions"][g].max()) + 1
        alone = dict(case, q=case["q"][g : g + 1], slots=case["slots"][g : g + 1, :n],
                     positions=case["positions"][g : g + 1])
        assert torch.equal(cpu_attention.paged_attention(**alone), batch[g : g + 1])


def test_a_compiled_caller_keeps_the_kernel_in_its_graph():
    """As engine.worker.compiled builds forwards on the CPU: inductor with its C++ wrapper, one graph, no break."""
    case = _case(random.Random(2), 4, 3, 4, 2, 32)

    def layer(q, k_cache, v_cache, slots, positions):
        return torch.ops.specd.paged_attention(q * 2, k_cache, v_cache, slots, positions, 0.125) + 1

    compiled = torch.compile(layer, fullgraph=True, options={"cpp_wrapper": True})
    args = [case[k] for k in ("q", "k_cache", "v_cache", "slots", "positions")]
    torch.testing.assert_close(compiled(*args), layer(*args), atol=0, rtol=0)


def test_loading_the_kernel_leaves_the_processes_floating_point_state_alone():
    """Built with -ffast-math, the library must not switch on flush-to-zero for the whole process (what gcc's
    crtfastmath.o does when it is linked in): subnormal floats stay subnormal, in Python and in torch, in a fresh
    interpreter that loads it."""
    code = (
        "import sys, torch\n"
        "from engine.layers import cpu_attention\n"
        "assert cpu_attention.kernel() is not None\n"
        "tiny = sys.float_info.min / 4\n"
        "assert tiny > 0, 'flush-to-zero in Python floats'\n"
        "assert (torch.tensor([sys.float_info.min], dtype=torch.float64) / 4).item() > 0, 'flush-to-zero in torch'\n"
        "assert (torch.tensor([1e-39]) * 1.0).item() > 0, 'denormals-are-zero in float32'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_layers_the_kernel_does_not_take_keep_the_gather_path():
    case = _case(random.Random(3), 2, 2, 4, 2, 32)
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    assert cpu_attention.usable(q, k, v, None)
    assert not cpu_attention.usable(q, k, v, 16)  # a sliding window
    assert not cpu_attention.usable(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert not cpu_attention.usable(q, k, torch.zeros(SLOTS, 2, 16), None)  # values of their own width
    assert not cpu_attention.usable(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, None)  # not [slots, Hkv, D]
    with pytest.raises(ValueError, match="specd::paged_attention"):
        cpu_attention.paged_attention(**dict(case, v_cache=torch.zeros(SLOTS, 2, 16)))


def test_the_runner_sends_short_queries_through_the_kernel_with_the_gather_paths_logits(model_sets, monkeypatch):
    """A decode-and-verify batch of the tiny llama: every layer calls the kernel once, and the logits are those of
    the same batch with the kernel turned off."""
    runner = ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu")
    runner.allocate_cache(num_blocks=40, block_size=4)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
    tables = [[3, 1], [0], [7, 2, 9]]
    split = [4, 3, 9]  # then 3, 1 and 1 new tokens: a padded [3, 3] short group
    runner.forward(ForwardBatch([s[:k] for s, k in zip(seqs, split)], [0, 0, 0], tables, [0, 0, 0]))
    rest = ForwardBatch([s[k:] for s, k in zip(seqs, split)], split, tables, [len(s) - k for s, k in zip(seqs, split)])

    calls = []
    kernel = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a: calls.append(a[0].shape) or kernel(*a))
    logits = runner.forward(rest)
    assert calls == [(3, 3, 4, 16)] * runner.model.config.num_hidden_layers

    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    torch.testing.assert_close(logits, runner.forward(rest), atol=1e-5, rtol=1e-5)


def test_a_lone_sequence_in_consecutive_blocks_reads_its_span_through_the_kernel(model_sets, monkeypatch):
    """At batch 1 the cache's blocks come in order: the short group is one span, which the kernel reads as slots
    [first, first + C), with the logits of SDPA over the span's view."""
    runner = ModelRunner.load(str(model_sets["llama"].target), "float32", "cpu")
    runner.allocate_cache(num_blocks=40, block_size=4)
    seq, table = list(range(5, 40)), [6, 7, 8, 9, 10, 11, 12, 13, 14]
    runner.forward(ForwardBatch([seq[:31]], [0], [table], [0]))
    rest = ForwardBatch([seq[31:]], [31], [table], [len(seq) - 31])  # 4 tokens, as a verify step

    calls = []
    kernel = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a: calls.append(a[3].tolist()) or kernel(*a))
    logits = runner.forward(rest)
    assert calls == [[list(range(6 * 4, 6 * 4 + len(seq)))]] * runner.model.config.num_hidden_layers

    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    torch.testing.assert_close(logits, runner.forward(rest), atol=1e-5, rtol=1e-5)
