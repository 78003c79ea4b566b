"""Profile the step-cost model at start-up with a few timed forwards, so the first requests already get a
sensible plan; every later step corrects it (engine.speculative.step_cost)."""

from __future__ import annotations

import logging
import math
import time

from engine.speculative.controller import GoodputController
from engine.speculative.eagle import EagleRunner
from engine.speculative.step_cost import HostCost, LinearCost
from engine.worker.forward_batch import ForwardBatch
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Host work per sequence before any step measured it (asking the lookups, a speculative step's bookkeeping):
# a guess of the right order on CPU and GPU hosts alike, which the first steps replace.
HOST_PRIOR_SECONDS = 3e-5
PASSES = 5  # timed passes over the profile's forwards
SPIKE, RETRIES = 1.5, 2  # a size re-timed (up to RETRIES more rounds of passes) where it costs SPIKE x a larger one


def _timed(runner: ModelRunner | EagleRunner, batches: list[ForwardBatch], passes: int = PASSES) -> list[float]:
    """Each batch's best time over ``passes`` passes over all of them. Interleaved, not each batch's repeats in a
    row: a neighbour's burst of work (another server compiling on the same cores) then costs one pass of a few
    sizes, not every repeat of one size; three servers starting on 2 cores had priced one sequence's 9-token
    verify at 230 ms beside 32 ms for 18 tokens, and no plan ever fed 9 tokens again to correct it."""
    best = [math.inf] * len(batches)
    for _ in range(passes):
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            runner.forward(batch)
            runner.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _spikes(runs: list[tuple[int, int, int]], seconds: list[float]) -> list[int]:
    """The runs that cost over SPIKE times a larger forward of the same layout after the same context: a forward
    of fewer tokens can cost more on a CPU (other kernels), not several times more."""
    out = []
    for i, (b, n, start) in enumerate(runs):
        larger = [seconds[j] for j, (b2, n2, s2) in enumerate(runs)
                  if s2 == start and (n2 > 1) == (n > 1) and b2 * n2 > b * n]
        if larger and seconds[i] > SPIKE * min(larger):
            out.append(i)
    return out


def _runs(k_max: int, block_size: int, max_tokens: int, blocks: int, max_seqs: int) -> list[tuple[int, int, int]]:
    """The profiled forwards, as (sequences, tokens each, context before): one sequence decoding or verifying 1, 2,
    k_max / 2 or k_max drafts, 2 to 64 sequences each verifying k_max, 2 to 64 decoding (the layouts a compiled
    runner warmed up, so a compiled runner is timed compiled); each after a short cached context, the decode and
    the full verify after a longer one too (what context adds). The verifies reach the largest batch: a plan for
    64 sequences priced past the profile's end would follow its last segment, and a forward's cost is not that
    straight. Only those whose blocks fit in ``blocks``."""
    verify = k_max + 1
    room = blocks * block_size  # a tiny cache (a test's) still gets a profile, of the sizes it holds
    short, long = block_size, min(16 * block_size, 256, room // 4)
    per_seq = -(-(short + verify) // block_size)
    runs = [(1, n, short) for n in sorted({1, 2, 3, k_max // 2 + 1, verify})]
    runs += [(b, verify, short) for b in (2, 4, 8, 16, 32, 64)
             if b <= max_seqs and b * verify <= max_tokens and b * per_seq <= blocks]
    runs += [(b, 1, short) for b in (2, 4, 8, 16, 32, 64) if b <= max_seqs and b * per_seq <= blocks]
    runs += [(1, n, long) for n in (1, verify) if -(-(long + n) // block_size) <= blocks]
    return runs


def profile_blocks(k_max: int, block_size: int, max_tokens: int, max_seqs: int) -> int:
    """The most blocks the profile's forwards write into, given all they could want."""
    runs = _runs(k_max, block_size, max_tokens, 1 << 30, max_seqs)
    return max(b * -(-(start + n) // block_size) for b, n, start in runs)


def calibrate(controller: GoodputController, target: ModelRunner, drafters: dict[str, ModelRunner | EagleRunner | None],
              block_size: int, max_tokens: int, num_blocks: int, max_seqs: int, first_block: int = 0,
              when: str = "at start-up") -> None:
    """Profiles the target's forwards and each model drafter's into the step-cost model; writes into blocks
    ``first_block`` to ``num_blocks``, which nobody may own (their contents are garbage-by-design). ``drafters``:
    the runner behind each model drafter's forwards, by source name; ``max_tokens``: the most a step feeds.
    ``when``: for the log (a later profile: the compiled forwards took over)."""
    k_max = controller.k_max
    verify = k_max + 1
    blocks = num_blocks - first_block
    runs = _runs(k_max, block_size, max_tokens, blocks, max_seqs)
    short = block_size
    batches = []
    for b, n, start in runs:
        per = -(-(start + n) // block_size)
        tables = [list(range(first_block + i * per, first_block + (i + 1) * per)) for i in range(b)]
        batches.append(ForwardBatch([[0] * n] * b, [start] * b, tables, [n] * b))
    seconds = _timed(target, batches)
    for _ in range(RETRIES):
        if not (spikes := _spikes(runs, seconds)):
            break
        for i, t in zip(spikes, _timed(target, [batches[i] for i in spikes])):
            seconds[i] = min(seconds[i], t)
    if spikes := _spikes(runs, seconds):
        logger.info("goodput controller: %d profiled sizes still cost over %.1fx a larger one after re-timing "
                    "(kept; the steps correct them): %s", len(spikes), SPIKE, [runs[i] for i in spikes])
    controller.cost.target.set_profile([(b * n, b * n * (start + n) / 1000.0, t, n > 1)
                                        for (b, n, start), t in zip(runs, seconds)])
    for name, runner in drafters.items():
        if runner is None:
            continue
        sizes = (1, verify)
        table = list(range(first_block, first_block + -(-(short + verify) // block_size)))
        # One logits row, as the drafter's own forwards give (a catch-up of n tokens, then one-token decodes): a
        # draft model's graph files leave out the layouts that return several rows of one sequence, which ran
        # eagerly here and priced its tokens at 8x what the compiled forwards cost.
        timed = _timed(runner, [ForwardBatch([[0] * n], [short], [table[: -(-(short + n) // block_size)]], [1])
                                for n in sizes])
        fit = controller.cost.drafters[name] = LinearCost()  # the forward in use now, not the one before
        # Its eager catch-ups are only timed when one runs, like the host terms below: the eager phase's (12.5 ms a
        # forward beside the compile child) go, and until one is timed they are priced at the compiled forwards'.
        controller.cost.catch_ups[name] = LinearCost()
        for n, t in zip(sizes, timed):
            fit.observe(n, t)
    # The host terms start again from the prior with every profile, as the forwards' do: what the eager steps taught
    # them was measured beside the compile child. What a speculating step adds (``host``) is only measured where a
    # plan speculates, so a price learned too high is never corrected: a first start on a CPU with no shipped
    # graphs served eagerly for 10 minutes, learned 4.2 ms a speculating step (0.98 ms a draft model's sequence)
    # and 0.2-0.9 ms an ask of the lookups, and speculated in none of the compiled steps after: 0.99x no speculation
    # on code at batch 1, where the same server loading its graphs at start ran 1.85x, and a first start restarting
    # them 2.01x (benchmarks/results/host_terms_trap_avx512.json, first_start_avx512.json).
    cost = controller.cost
    cost.host, cost.host_plain, cost.lookup = HostCost(), LinearCost(), LinearCost()
    for fit in (cost.lookup, cost.host.pooled, cost.host_plain):
        fit.observe(1, HOST_PRIOR_SECONDS)
        fit.observe(8, 8 * HOST_PRIOR_SECONDS)
    logger.info("goodput controller: step cost model %s %s", when,
                ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in controller.cost.parameters().items()))
