"""Structured outputs through the OpenAI API: 50 JSON schemas written for the tests x 2 prompts each
(tests/json_schemas.py: nested objects, bounded arrays, enums, ranged numbers, patterns, optional fields), asked
with the real `openai` client of `serve` over a real tritonserver, 8 at a time (the engine batches them).

Greedy: every answer is complete, parses and validates (jsonschema), and spork and plain give the same text in the
same number of tokens. Sampled (temperature 0.8, a seed per case): every answer is complete and validates, spork's
and plain's alike (speculative sampling keeps plain sampling's distribution, not each draw: the same seed need not
give the same text, so sampled answers are not compared)."""
from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.json_schemas import MAX_TOKENS, SCHEMAS, cases
from tests.test_openai_api import start_serve

pytestmark = pytest.mark.slow
SAMPLED = {"temperature": 0.8}


@pytest.fixture(scope="module")
def api(default_engines, tmp_path_factory):
    import openai

    proc, base, name = start_serve(["--engines", str(default_engines)], tmp_path_factory.mktemp("schemas"))
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300), name
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_fifty_schemas_validate_greedy_and_sampled_and_spork_is_plain(api):
    import jsonschema

    client, model = api
    assert len(SCHEMAS) == 50 and len(cases()) == 100

    def ask(job):
        i, (name, schema, prompt), mode, sampled = job
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            extra_body={"spec_mode": mode}, **({**SAMPLED, "seed": 1000 + i} if sampled else {}))
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    jobs = [(i, case, mode, sampled) for i, case in enumerate(cases()) for mode in ("spork", "plain")
            for sampled in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip([(j[0], j[2], j[3]) for j in jobs], pool.map(ask, jobs)))
    for i, (name, schema, prompt) in enumerate(cases()):
        for mode in ("spork", "plain"):
            for sampled in (False, True):
                text, finish, _ = answers[i, mode, sampled]
                assert finish == "stop", (name, prompt, mode, sampled, text)
                jsonschema.validate(json.loads(text), schema)
        assert answers[i, "spork", False] == answers[i, "plain", False], (name, prompt)


def test_n_logprobs_and_response_format_together(api):
    """n choices, logprobs and a JSON schema in one request, streamed and not: every choice is a valid document
    whose tokens' bytes spell it, each token with its top alternatives among those the grammar allows, the chosen one
    among them or below them (greedy: the likeliest); greedy choices are one answer n times; sampled ones with a seed are each the one-choice answer of
    seed + i, streamed or not."""
    import jsonschema

    client, model = api
    name, schema, prompt = cases()[4]  # nested objects
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, logprobs=True,
              top_logprobs=2, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    greedy = client.chat.completions.create(**kw, n=3, temperature=0)
    sampled = client.chat.completions.create(**kw, n=3, temperature=0.8, seed=7)
    for r in (greedy, sampled):
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)
            lps = c.logprobs.content
            assert b"".join(bytes(t.bytes) for t in lps).decode() == c.message.content
            # alternatives the grammar forbids are none: a token it forces alone has one, and probability 1
            assert all(len(t.top_logprobs) == 2 or (len(t.top_logprobs) == 1 and t.logprob == 0) for t in lps)
            assert all(any(a.token == t.token for a in t.top_logprobs) or t.logprob < t.top_logprobs[-1].logprob
                       for t in lps)
    assert len({c.message.content for c in greedy.choices}) == 1
    assert all(t.token == t.top_logprobs[0].token for t in greedy.choices[0].logprobs.content)
    alone = [client.chat.completions.create(**kw, temperature=0.8, seed=7 + i).choices[0].message.content
             for i in range(3)]
    assert [c.message.content for c in sampled.choices] == alone
    texts = [""] * 3
    for chunk in client.chat.completions.create(**kw, n=3, temperature=0.8, seed=7, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == alone
