"""``specd serve --tensor-parallel-size 2`` as a user runs it: the real command, which starts its second rank
itself, answering the official openai client with the target's own greedy output; a clean stop stops both ranks
(exit 0), and a lost rank takes the server down (exit 1, a log line naming it), never a hang."""

from __future__ import annotations

import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.engine.lossless import MAX_NEW, Reference, assert_same_as_target, prompts_for
from tests.server.conftest import CHAT_TEMPLATE
from tests.server.test_cli import Process

MODEL = "tp-llama"


def start(model_sets, tmp) -> Process:
    ms = model_sets["llama"]
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    proc = Process(tmp, ["--chat-template", str(tmp / "chat.jinja"),
        "--model", str(ms.target), "--draft-model", str(ms.draft), "--speculative-method", "hybrid",
        "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2", "--served-model-name", MODEL,
    ])
    proc.wait_ready()
    return proc


@pytest.fixture(scope="module")
def server(model_sets, tmp_path_factory):
    proc = start(model_sets, tmp_path_factory.mktemp("tp-server"))
    yield proc
    if proc.proc.poll() is None:
        proc.proc.kill()


def client(proc: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=60)


def worker_pids(proc: Process) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.proc.pid), "-f", "engine.parallel"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


def test_concurrent_completions_from_two_ranks_equal_the_target_alone(server, model_sets, tokenizer_dir):
    ref = Reference(model_sets["llama"].target)
    prompts = prompts_for(tokenizer_dir)

    def complete(prompt: list[int]) -> openai.types.Completion:
        return client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                                 extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch across the ranks, as concurrent users make one
        answers = list(pool.map(complete, prompts))
    for prompt, resp in zip(prompts, answers):
        assert_same_as_target(ref, prompt, resp.choices[0].model_extra["token_ids"], "2 ranks over HTTP")
    assert sum(r.usage.model_extra["spec_draft_tokens"] for r in answers) > 0, "nothing was drafted"


def test_a_chat_stream_from_two_ranks_concatenates_to_its_plain_answer(server):
    c = client(server)
    messages = [{"role": "user", "content": "def fib(n):"}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0)
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == plain.choices[0].message.content and plain.usage.completion_tokens > 0


def test_sigterm_stops_rank_0_and_then_the_other_rank_cleanly(server):
    workers = worker_pids(server)
    assert len(workers) == 1, server.log.read_text()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0, server.log.read_text()
    assert "tensor-parallel rank 1: stopped by rank 0" in server.log.read_text()


def test_a_lost_rank_takes_the_server_down_with_exit_1_and_a_line_naming_it(model_sets, tmp_path):
    proc = start(model_sets, tmp_path)
    (worker,) = worker_pids(proc)
    subprocess.run(["kill", "-9", str(worker)], check=True)
    assert proc.wait_exit(timeout=60) == 1, proc.log.read_text()
    assert "tensor-parallel rank 1 exited with code -9" in proc.log.read_text()
