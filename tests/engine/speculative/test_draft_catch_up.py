"""The draft model's catch-up (tokens it has not seen, after a preemption or lookup steps) is counted
against max_num_batched_tokens, so the budget bounds a step's real work."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.engine.lossless import Reference, assert_equal_unless_near_tie, prompts_for

BUDGET = 16


def test_draft_catch_up_after_preemption_stays_inside_the_token_budget(model_sets, tokenizer_dir):
    ms = model_sets["llama"]
    llm = LLM(model=str(ms.target), draft_model=str(ms.draft), speculative_method="draft_model",
              num_speculative_tokens=4, dtype="float32", device="cpu", max_num_batched_tokens=BUDGET,
              num_kv_blocks=12, max_model_len=128)
    engine = llm.engine
    fed = {"target": 0, "draft": 0}
    for name, runner in (("target", engine.target), ("draft", engine.drafting.source("draft_model").runner)):
        def counting(batch, _forward=runner.forward, _name=name):  # noqa: ANN001, ANN202
            fed[_name] += sum(len(t) for t in batch.token_ids)
            return _forward(batch)
        runner.forward = counting
    step, catch_ups, preempted = engine.step, [], [0]

    def checked_step():  # noqa: ANN202
        fed["target"] = fed["draft"] = 0
        outputs = step()
        if engine.last_step is not None:
            # The draft model feeds one token per draft it proposes; anything more is catch-up.
            catch_up = fed["draft"] - engine.last_step.num_draft_tokens
            assert fed["target"] + catch_up <= BUDGET, f"{fed} with {catch_up} tokens of catch-up"
            catch_ups.append(catch_up)
            preempted[0] += engine.last_step.num_preempted
        return outputs

    engine.step = checked_step
    prompts = prompts_for(tokenizer_dir)
    outs = llm.generate(prompts, SamplingParams(max_tokens=90, temperature=0.0))
    assert preempted[0] > 0 and max(catch_ups) >= BUDGET // 2, f"no catch-up after preemption: {catch_ups}"
    ref = Reference(ms.target)
    for p, o in zip(prompts, outs):
        assert_equal_unless_near_tie(ref, p, o.token_ids, ref.greedy(p, 90), "after preemptions and a chunked catch-up")
