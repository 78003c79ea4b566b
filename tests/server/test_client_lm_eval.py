"""lm-evaluation-harness against the live server, unmodified: its `local-completions` model on two local tasks.

A multiple-choice task (loglikelihood: echo + logprobs over token-id prompts), whose answers are what the target's
own logprobs pick in a plain transformers forward, and a generate_until task whose targets are the server's own
greedy outputs. Both read local JSON files: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from server.config import ServerConfig
from tests.server.conftest import MODEL, LiveServer, tiny_engine

pytestmark = pytest.mark.timeout(300)

QUESTIONS = [
    ("def fib(n):\n    if n < 2:\n        return", [" n", " fib", " 0"]),
    ("for i in range(10):\n   ", [" print(i)", " return i", " pass"]),
    ("class Point:\n    def", [" __init__(self, x, y):", " area(self):", " x"]),
    ("import os\nprint(", ["os.getcwd())", "'hello')", "1 + 2)"]),
]
PROMPTS = ["def add(a, b):\n", "class Stack:\n"]


@pytest.fixture(scope="module")
def live(model_sets, chat_target):
    engine = tiny_engine(chat_target, model_sets["llama"].draft, k=4)
    server = LiveServer(ServerConfig(model=str(chat_target), draft_model=str(model_sets["llama"].draft),
                                     served_model_name=MODEL), engine)
    yield server
    server.stop()


def loglikelihood(model, tok, context: str, continuation: str) -> float:
    """As the harness builds a pair's tokens: trailing spaces of the context move to the continuation, whose
    tokens are the whole text's past as many as the context has alone, after the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ids = tok.encode(context, add_special_tokens=False)
    n = len(ids)
    ids += whole[n:]
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(n, len(ids))))


def test_lm_eval_scores_multiple_choice_and_generates_through_the_server(live, chat_target, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(chat_target, dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(chat_target)
    docs, want = [], {}
    for question, choices in QUESTIONS:
        scores = [loglikelihood(model, tok, question, c) for c in choices]
        ranked = sorted(scores, reverse=True)
        assert ranked[0] - ranked[1] > 1e-3, "a near-tie would make the task's answer a matter of rounding"
        docs.append({"question": question, "choices": choices, "answer": scores.index(ranked[0])})
        want.update({(question, c): s for c, s in zip(choices, scores)})
    client = live.client()
    greedy = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
              for p in PROMPTS]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": g}) + "\n"
                                                for p, g in zip(PROMPTS, greedy)))
    (tmp_path / "specd_mc.yaml").write_text(f"""task: specd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (tmp_path / "specd_gen.yaml").write_text(f"""task: specd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<never>"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    args = (f"model={MODEL},base_url={live.url}/v1/completions,tokenizer={chat_target},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    out = simple_evaluate(model="local-completions", model_args=args, tasks=["specd_mc", "specd_gen"],
                          task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    assert out["results"]["specd_mc"]["acc,none"] == 1.0
    assert out["results"]["specd_gen"]["exact_match,none"] == 1.0
    for sample in out["samples"]["specd_mc"]:  # each choice's loglikelihood, as the harness summed it
        for (context, continuation), (score, _greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            assert abs(score - want[(context, continuation)]) < 1e-3, (context, continuation, score)
