"""Prefix caching over HTTP: usage.prompt_tokens_details.cached_tokens as OpenAI reports it, and the
prefix cache's Prometheus counters, through the official openai client."""

from __future__ import annotations

from tests.server.test_metrics import GREEDY, MODEL, Scrape, delta


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(server):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, and the prefix cache's counters in tokens."""
    client = server.client()
    prompt = list(range(200, 241))  # 41 tokens: two full blocks of 16 can come from the cache
    server.wait_idle()
    before = Scrape.of(server)
    cold = client.completions.create(prompt=prompt, max_tokens=4, **GREEDY)
    warm = client.completions.create(prompt=prompt, max_tokens=4, n=2, **GREEDY)
    stream = client.completions.create(
        prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    streamed = [c for c in stream][-1].usage
    server.wait_idle()
    after = Scrape.of(server)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    # n = 2: counted once per prompt, like prompt_tokens (the second choice reuses the first's too).
    assert warm.usage.prompt_tokens_details.cached_tokens == 32
    assert streamed.prompt_tokens_details.cached_tokens == 32
    assert [c.text for c in warm.choices] == [cold.choices[0].text] * 2
    assert delta(before, after, "specd:prefix_cache_queries_total", model_name=MODEL) == 4 * 41
    assert delta(before, after, "specd:prefix_cache_hits_total", model_name=MODEL) == 3 * 32
