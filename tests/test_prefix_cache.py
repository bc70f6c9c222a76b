"""Prefix reuse in the KV pool on tiny seeded random models: a prompt that starts with a finished request's rows
reuses them and gets exactly the tokens it gets with reuse off (greedy and seeded sampling, plain and drafted);
a hit is checked token by token; eviction is LRU and never blocks admission; reuse stays within a request's
cache scope (its tenant)."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.loop.prefix_cache import BLOCK, PrefixCache
from spork_trt.loop.request import Submission
from tests.conftest import core_requests, run_core
from tests.test_core import drafter, engine, tiny  # noqa: F401 - the module's tiny models fixture

FIRST = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(3)).tolist()


def ask(tiny, kind, prompt, draft="plain", sampling=SamplingConfig(), n=20, scope=""):  # noqa: F811
    from spork_trt.config import SpecConfig
    spec = SpecConfig.for_draft("early-exit" if draft == "early" else "ngram")
    return Submission(prompt, GenerateConfig(max_new_tokens=n, sampling=sampling), frozenset(), spec,
                      drafter(tiny, kind, draft, sampling), cache_scope=scope)


@pytest.mark.parametrize("kind,draft,sampling", [("onnx", "plain", SamplingConfig()), ("onnx", "ngram", SamplingConfig()),
                                                 ("torch", "early", SamplingConfig()),
                                                 ("torch", "early", SamplingConfig(temperature=0.8, seed=7))])
def test_a_second_turn_reuses_the_first_turn_s_rows_and_answers_the_same(tiny, kind, draft, sampling):  # noqa: F811
    """Turn two = turn one's prompt + its answer + a new message: it is admitted onto turn one's slot, prefills
    only the new part, and its tokens equal those with reuse off."""
    answers, cached = {}, {}
    for reuse in (True, False):
        core = EngineCore(engine(tiny, kind), 256, CoreConfig(slots=2, max_len=128, prefix_reuse=reuse))
        first = run_core(core, [ask(tiny, kind, FIRST, draft, sampling)])[0]
        second = FIRST + first.token_ids + [7, 8, 9, 10, 11]
        out = run_core(core, [ask(tiny, kind, second, draft, sampling), ask(tiny, kind, FIRST[:20], draft, sampling)])
        answers[reuse] = [first.token_ids, out[0].token_ids, out[1].token_ids]
        cached[reuse] = (out[0].stats.cached_tokens, core.prefixes.stats.hits, core.pool.in_use)
    assert answers[True] == answers[False]
    # the first turn's rows: its prompt and answer as far as the target ran them (its last token never ran); the
    # short prompt admitted beside it copies 19 of them from the running second turn (a second hit)
    assert cached[True] == (len(FIRST) + 20 - 1, 2, 0) and cached[False] == (0, 0, 0)


def test_eviction_is_least_recently_kept_and_never_blocks(tiny):  # noqa: F811
    core = EngineCore(engine(tiny, "onnx"), 256, CoreConfig(slots=2, max_len=128))
    a, b, c = FIRST, FIRST[::-1], [5] * 30
    run_core(core, [ask(tiny, "onnx", a, n=4)])
    run_core(core, [ask(tiny, "onnx", b, n=4)])
    assert len(core.prefixes.kept) == 2  # both slots hold a finished request's rows
    run_core(core, [ask(tiny, "onnx", c, n=4)])  # no hit: the least recently kept (a's) is evicted
    assert core.prefixes.stats.evictions == 1 and core.prefixes.match(a + [1])[0] is None
    assert core.prefixes.match(b + [1])[1] == len(b)
    out = run_core(core, [ask(tiny, "onnx", b + [1, 2], n=4)])[0]
    assert out.stats.cached_tokens == len(b) and core.prefixes.stats.hits == 1


def test_a_hit_is_checked_token_by_token_and_keeps_the_last_prompt_token():
    class Pool:
        free, caches = [0, 1], None

    cache = PrefixCache(Pool())
    cache.kept, cache.used = {0: tuple(range(40)), 1: tuple(range(20)) + (99,) * 20}, {0: 0, 1: 1}
    cache.scopes = {0: "", 1: ""}
    cache.blocks = {}
    for s, toks in cache.kept.items():
        from spork_trt.loop.prefix_cache import chain_hashes
        for h in chain_hashes(toks):
            cache.blocks.setdefault(h, set()).add(s)
    assert cache.match(list(range(40))) == (0, 39)  # all but the last prompt token
    assert cache.match(list(range(25)) + [5]) == (0, 25)
    assert cache.match(list(range(BLOCK - 1)) + [0, 1]) == (None, 0)  # under one block in common
    cache.kept[0] = (1,) * 40  # as if a hash collided: the tokens decide
    assert cache.match(list(range(40)))[0] == 1


@pytest.mark.parametrize("kind,draft", [("onnx", "plain"), ("onnx", "ngram"), ("torch", "early")])
def test_a_request_shares_the_rows_of_a_running_one(tiny, kind, draft):  # noqa: F811
    """Two requests on one document, the second arriving while the first still runs: the first's committed rows are
    copied into the second's slot, which prefills only the rest, and both answer exactly as with reuse off."""
    doc = FIRST + FIRST[::-1][:5]  # 42 tokens, two whole blocks and more
    subs = lambda: [ask(tiny, kind, doc + [1, 2, 3], draft, n=30), ask(tiny, kind, doc + [4, 5], draft, n=20)]  # noqa: E731
    answers, cached = {}, {}
    for reuse in (True, False):
        core = EngineCore(engine(tiny, kind), 256, CoreConfig(slots=2, max_len=128, prefix_reuse=reuse))
        reqs = core_requests(core, subs(), join_at={1: 3})
        answers[reuse] = [r.result().token_ids for r in reqs]
        cached[reuse] = (reqs[0].stats.cached_tokens, reqs[1].stats.cached_tokens, core.prefixes.stats.shared)
    assert answers[True] == answers[False] and len(answers[True][0]) == 30
    assert cached[True] == (0, len(doc), 1) and cached[False] == (0, 0, 0)


def test_reuse_stays_within_a_scope_kept_or_running(tiny):  # noqa: F811
    """Another tenant's kept rows are never reused (its cached_tokens stay 0: they cannot confirm a guess at
    another's prompt), the same tenant's are; a running request's rows are copied only within its scope; every
    answer is the one it gets alone."""
    core = EngineCore(engine(tiny, "onnx"), 256, CoreConfig(slots=3, max_len=128))
    alone = {tuple(p): run_core(EngineCore(engine(tiny, "onnx"), 256, CoreConfig(slots=1, max_len=128,
                                                                                  prefix_reuse=False)),
                                [ask(tiny, "onnx", p, n=4)])[0].token_ids for p in (FIRST, FIRST + [1, 2])}
    first = run_core(core, [ask(tiny, "onnx", FIRST, n=4, scope="alice")])[0]
    bob = run_core(core, [ask(tiny, "onnx", FIRST + [1, 2], n=4, scope="bob")])[0]
    alice = run_core(core, [ask(tiny, "onnx", FIRST + [1, 2], n=4, scope="alice")])[0]
    assert (first.stats.cached_tokens, bob.stats.cached_tokens, alice.stats.cached_tokens) == (0, 0, len(FIRST))
    assert [first.token_ids, bob.token_ids, alice.token_ids] == [alone[tuple(FIRST)], *[alone[tuple(FIRST + [1, 2])]] * 2]
    core = EngineCore(engine(tiny, "onnx"), 256, CoreConfig(slots=2, max_len=128))
    reqs = core_requests(core, [ask(tiny, "onnx", FIRST + [3], n=30, scope="alice"),
                                ask(tiny, "onnx", FIRST + [4], n=4, scope="bob")], join_at={1: 3})
    assert [r.stats.cached_tokens for r in reqs] == [0, 0] and core.prefixes.stats.shared == 0
