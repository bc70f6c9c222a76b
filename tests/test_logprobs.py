"""Log-probabilities (spork_trt/spec/logprobs.py) on the real default model and its default target (int4 on the CPU
torch engine, row-invariant): each committed token's is the same under speculation (every drafter kind), batched
with others and alone, to 1e-6 on 16 prompts; greedy picks the likeliest; a grammar's forbidden tokens never appear
among the alternatives; gate mode and a bad count are refused in one line. (The fp32 reference engine is not
row-invariant: its rows differ by about 5e-6 alone and batched, so it is not the target here.)"""
from __future__ import annotations

import json
import math

import pytest

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.errors import UserError
from spork_trt.loop.generate import run_many
from spork_trt.spec.grammar import GrammarSpec

pytestmark = pytest.mark.slow

TOPICS = ["the moon", "a river", "bread", "chess", "rain", "a library", "trains", "honey", "winter", "a violin",
          "volcanoes", "tea", "the ocean", "bicycles", "owls", "a lighthouse"]
PROMPTS = [f"Repeat after me: I like {t} because {t} is good. I like {t}" for t in TOPICS]  # 16: text to copy
N, K = 24, 5


def close(a, b) -> bool:
    """Two requests' logprobs agree: same tokens, each value and alternative within 1e-6."""
    return len(a) == len(b) and all(
        x.token == y.token and abs(x.logprob - y.logprob) <= 1e-6 and [t for t, _ in x.top] == [t for t, _ in y.top]
        and all(abs(p - q) <= 1e-6 for (_, p), (_, q) in zip(x.top, y.top)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runtime():
    from spork_trt.loop.runtime import Runtime

    return Runtime.load(dtype="int4")


@pytest.fixture(scope="module")
def plain(runtime):
    rt, cfg = runtime, GenerateConfig(max_new_tokens=N)
    return {p: rt.generate(rt.tokenizer.encode_prompt(p), cfg, mode="plain", logprobs=K) for p in PROMPTS}


def test_greedy_tokens_are_the_likeliest_and_every_token_has_one(plain):
    for res in plain.values():
        assert len(res.logprobs) == len(res.token_ids) and [x.token for x in res.logprobs] == res.token_ids
        for x in res.logprobs:
            assert len(x.top) == K and x.top[0] == (x.token, x.logprob)  # greedy: the argmax, ties to the lower id
            assert x.logprob <= 0 and sum(math.exp(v) for _, v in x.top) <= 1 + 1e-9
            assert [v for _, v in x.top] == sorted((v for _, v in x.top), reverse=True)


@pytest.mark.parametrize("draft", ["ngram", "self-int4", "early-exit:8"])
def test_spork_logprobs_are_plains_alone_and_batched(runtime, plain, draft):
    rt, cfg, spec = runtime, GenerateConfig(max_new_tokens=N), SpecConfig.for_draft(draft)
    subs = [rt.request(rt.tokenizer.encode_prompt(p), cfg, "spork", spec, logprobs=K) for p in PROMPTS]
    batched = {r.sub: r.result() for r in run_many(rt.engine, subs, slots=4, max_len=256)}
    for p, sub in zip(PROMPTS, subs):
        assert batched[sub].token_ids == plain[p].token_ids, (draft, p)
        assert close(batched[sub].logprobs, plain[p].logprobs), (draft, p)
    for p in PROMPTS[:4]:  # alone too
        alone = rt.generate(rt.tokenizer.encode_prompt(p), cfg, mode="spork", spec=spec, logprobs=K)
        assert close(alone.logprobs, plain[p].logprobs), (draft, p)
    assert sum(batched[s].stats.draft_tokens for s in subs) > 0  # trees were verified: rows beside other rows
    assert draft.startswith("early-exit") or sum(batched[s].stats.accepted_tokens for s in subs) > 0  # accepted


def test_sampled_tokens_carry_their_own_logprob(runtime):
    """Sampled (speculation keeps the distribution, not the draws): every token has a finite logprob of its own."""
    rt = runtime
    cfg = GenerateConfig(max_new_tokens=N, sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=7))
    ids = rt.tokenizer.encode_prompt(PROMPTS[0])
    for mode, spec in (("plain", SpecConfig()), ("spork", SpecConfig.for_draft("self-int4"))):
        res = rt.generate(ids, cfg, mode=mode, spec=spec, logprobs=0)
        assert [x.token for x in res.logprobs] == res.token_ids
        assert all(x.top == () and -math.inf < x.logprob <= 0 for x in res.logprobs)


def test_under_a_grammar_the_alternatives_are_allowed_tokens(runtime):
    rt = runtime
    spec = GrammarSpec("json", "")
    ids = rt.tokenizer.encode_prompt("Describe a cat as JSON.")
    res = rt.generate(ids, GenerateConfig(max_new_tokens=32), mode="plain", grammar=spec, logprobs=K)
    first = res.logprobs[0]
    assert rt.tokenizer.decode([first.token]).lstrip().startswith(("{", "["))
    allowed = [t for t, v in first.top if v > -math.inf]
    assert all(rt.tokenizer.decode([t]).strip()[:1] in ("{", "[", "") for t in allowed)
    if res.stop_reason == "eos":
        json.loads(res.text)


def test_forced_tokens_carry_the_masked_targets_logprobs(runtime):
    """Under a JSON schema, spork commits the tokens the grammar allows alone without a verdict (jump-forward):
    their logprobs (0, the token alone among the alternatives) are those plain decoding reads from the masked
    target's rows, and every other token's too."""
    rt = runtime
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "legs": {"type": "integer"}},
              "required": ["name", "legs"], "additionalProperties": False}
    spec, cfg = GrammarSpec("json_schema", json.dumps(schema)), GenerateConfig(max_new_tokens=40)
    ids = rt.tokenizer.encode_prompt("Describe a spider as JSON.")
    plain = rt.generate(ids, cfg, mode="plain", grammar=spec, logprobs=K)
    spork = rt.generate(ids, cfg, mode="spork", spec=SpecConfig.for_draft("ngram"), grammar=spec, logprobs=K)
    assert spork.stats.forced_tokens > 0 and spork.token_ids == plain.token_ids
    assert close(spork.logprobs, plain.logprobs)
    assert any(x.logprob == 0.0 and len(x.top) == 1 for x in spork.logprobs)


@pytest.mark.parametrize("kw, needle", [(dict(mode="gate", logprobs=0), "gate mode"),
                                        (dict(mode="plain", logprobs=21), "0 to 20")])
def test_refusals_are_one_line(runtime, kw, needle):
    rt = runtime
    with pytest.raises(UserError, match=needle):
        rt.request(rt.tokenizer.encode_prompt("hi"), GenerateConfig(max_new_tokens=4), **kw)
