"""The engine core on tiny seeded random models: many requests stepped together give each one exactly the tokens it
gets alone (greedy, and sampling with a seed), whatever joins, leaves, queues or is cancelled; the batched forward
of every engine equals its one-sequence forward; slots come back."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.spec.drafters import ModelDrafter, NgramDrafter
from spork_trt.engines import chain_input
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import QueueFull, UserError
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.loop.generate import generate
from spork_trt.loop.request import Submission
from spork_trt.spec.sampling import make_generator
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import core_requests, run_core, tiny_config

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9] * 12 + [4, 9, 9], [30, 31, 32, 33, 30, 31], [7, 8]]
LENGTHS = [30, 12, 25, 18, 40]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = random_checkpoint(tiny_config(), seed=5, scale=8.0).model
    graph = export_onnx(model, tmp_path_factory.mktemp("core") / "target.onnx")
    early = export_onnx(model, tmp_path_factory.mktemp("core") / "early.onnx", n_layers=1)
    return model, graph, early


def engine(tiny, kind: str):
    model, graph, _ = tiny
    return TorchEngine(model) if kind == "torch" else OnnxEngine(graph, model.cfg)


def drafter(tiny, kind: str, draft: str, sampling: SamplingConfig):
    model, _, early = tiny
    if draft == "plain":
        return None
    if draft == "ngram":
        return NgramDrafter(4)
    seed = None if sampling.seed is None else sampling.seed + 1
    # one draft engine per engine kind, shared as a runtime shares it: the core runs every request's draft depth
    # in one forward
    eng = DRAFT_ENGINES.setdefault((id(early), kind), early_engine(tiny, kind))
    return ModelDrafter(eng, sampling, make_generator(seed), share_prompt=True)


DRAFT_ENGINES: dict = {}


def early_engine(tiny, kind: str):
    model, _, early = tiny
    return TorchEngine(model, exit_layer=1) if kind == "torch" else OnnxEngine(early, model.cfg, n_layers=1)


def request(tiny, kind, i: int, draft: str, sampling=SamplingConfig(), adaptive: bool = True) -> Submission:
    cfg = GenerateConfig(max_new_tokens=LENGTHS[i], sampling=sampling)
    spec = SpecConfig.for_draft("early-exit" if draft == "early" else "ngram", adaptive=adaptive)
    return Submission(PROMPTS[i], cfg, frozenset(), spec, drafter(tiny, kind, draft, sampling))


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_forward_batch_equals_one_sequence_forwards(tiny, kind):
    eng = engine(tiny, kind)
    pool = eng.make_pool(3, 64)
    alone = eng.make_pool(3, 64)
    seqs = [chain_input(pool.caches[i], p) for i, p in enumerate(PROMPTS[:3])]
    got = eng.forward_batch(seqs)
    want = [eng.forward_batch([chain_input(alone.caches[i], p)])[0] for i, p in enumerate(PROMPTS[:3])]
    for g, w, p in zip(got, want, PROMPTS):
        assert g.shape == (len(p), eng.cfg.vocab_size)
        assert torch.allclose(g, w, atol=1e-4), (g - w).abs().max()
    for c, a, p in zip(pool.caches, alone.caches, PROMPTS):
        assert c.pending == a.pending == len(p)
        k, ka = torch.as_tensor(c.k), torch.as_tensor(a.k)
        assert torch.allclose(k, ka, atol=1e-5)  # the new rows went into each sequence's own slot
    # logits at asked-for rows only (none, the last, a few) are those rows of the full logits; the caches are the same
    ask = [(), (len(PROMPTS[1]) - 1,), (0, 2)]
    rows = eng.make_pool(3, 64)
    part = eng.forward_batch([chain_input(rows.caches[i], p, a) for i, (p, a) in enumerate(zip(PROMPTS, ask))])
    for g, w, a in zip(part, want, ask):
        assert g.shape == (len(a), eng.cfg.vocab_size) and torch.allclose(g, w[list(a)], atol=1e-4)
    for c, a in zip(rows.caches, alone.caches):
        assert torch.allclose(torch.as_tensor(c.k), torch.as_tensor(a.k), atol=1e-5)


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_forward_batch_with_uneven_contexts_equals_alone(tiny, kind):
    """A long context with one new token beside an empty one with a 7-token chunk (the GQA graph needs room for the
    padded chunk after every context: 60 + 7 > the slots' 64), then the same again: logits and rows equal alone."""
    eng = engine(tiny, kind)
    pool, alone = eng.make_pool(2, 64), eng.make_pool(2, 64)
    long = [(i * 7) % 30 + 1 for i in range(60)]
    for p in (pool, alone):
        eng.forward_batch([chain_input(p.caches[0], long)])
        p.caches[0].commit()
    for _ in range(2):
        got = eng.forward_batch([chain_input(pool.caches[0], [3]), chain_input(pool.caches[1], PROMPTS[0][:7])])
        want = [eng.forward_batch([chain_input(alone.caches[0], [3])])[0],
                eng.forward_batch([chain_input(alone.caches[1], PROMPTS[0][:7])])[0]]
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-4), (g - w).abs().max()
        for p in (pool, alone):
            p.caches[0].commit()
            p.caches[1].truncate(0)  # the empty one stays empty: its chunk comes again after the grown context
    for c, a in zip(pool.caches, alone.caches):
        assert torch.allclose(torch.as_tensor(c.k), torch.as_tensor(a.k), atol=1e-5)


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_batched_requests_equal_each_request_alone(tiny, kind):
    """Five requests (plain, n-gram, early-exit drafts) on three slots with small prefill chunks: some queue, some
    join mid-run; each one's tokens equal plain greedy decoding of it alone; requests of one drafter pool their
    acceptance odds. The second n-gram request has the fixed shape (every node of a proposal verified), so trees
    are verified whatever the timing-driven choices (allotment, draft switch) make of the adaptive ones under load."""
    draws = ["ngram", "plain", "early", "ngram", "early"]
    want = [generate(engine(tiny, kind), PROMPTS[i], GenerateConfig(max_new_tokens=LENGTHS[i]), frozenset()).token_ids
            for i in range(5)]
    core = EngineCore(engine(tiny, kind), 256, CoreConfig(slots=3, max_len=96, prefill_tokens=5))
    reqs = core_requests(core, [request(tiny, kind, i, d, adaptive=i != 3) for i, d in enumerate(draws)],
                         join_at={3: 4, 4: 9})
    assert [r.result().token_ids for r in reqs] == want
    assert reqs[3].stats.draft_tokens > 0 and core.pool.in_use == 0
    # the acceptance odds are pooled per drafter: both n-gram requests learned into (and read) the same table
    assert reqs[0].sched.odds is reqs[3].sched.odds is core.odds["ngram"]
    assert reqs[2].sched.odds is reqs[4].sched.odds is core.odds["early-exit"] is not core.odds["ngram"]
    assert any(core.odds.values())


@pytest.mark.parametrize("kind", ["torch", "onnx"])
def test_model_drafters_propose_together_what_they_propose_alone(tiny, kind):
    """drive: three drafters' catch-up chains and tree depths run as one forward per depth (each depth sees the
    committed rows, its chain and only its own ancestors' pending rows: SeqInput.seen); trees, scores and the rows
    they leave equal each drafter proposing alone, over two rounds with commits between."""
    from spork_trt.spec.drafters import drive
    from spork_trt.spec.verification import Verdict

    spec = SpecConfig(tree_width=2, tree_depth=3, tree_budget=5)
    shared = early_engine(tiny, kind)  # together: one engine for the three, as a runtime has; alone: one each
    sets = [[ModelDrafter(shared if together else early_engine(tiny, kind), SamplingConfig(), make_generator(None))
             for _ in range(3)] for together in (True, False)]
    for ds in sets:
        for d, p in zip(ds, PROMPTS):
            d.reset(p, 64)
    roots = [4, 8, 2]
    for rnd in range(2):
        got = drive([d.proposing(r, spec) for d, r in zip(sets[0], roots)])
        want = [d.propose(r, spec) for d, r in zip(sets[1], roots)]
        for g, w in zip(got, want):
            assert (g.tokens, g.parents) == (w.tokens, w.parents) and len(g) > 1
            assert torch.allclose(torch.tensor(g.score), torch.tensor(w.score), atol=1e-4)
        for a, b in zip(*sets):
            assert a.cache.pending == b.cache.pending and a.rows == b.rows
            c, rows = a.cache, list(range(a.cache.length + a.cache.pending))
            ka, kb = (torch.as_tensor(x.cache.k).index_select(c.axis, torch.tensor(rows)) for x in (a, b))
            assert torch.allclose(ka, kb, atol=1e-5)
        for ds in sets:  # the first child and its first child accepted, one bonus token: behind stays empty
            for d, tree, r in zip(ds, want, roots):
                path = [0, 1] + [i for i in range(2, len(tree)) if tree.parents[i] == 1][:1]
                d.commit(tree, Verdict(tuple(path), tuple(tree.tokens[i] for i in path[1:]), r))
        roots = [r + rnd + 1 for r in roots]


def test_sampled_requests_draw_the_same_tokens_batched_as_alone(tiny):
    sampling = [SamplingConfig(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3)]
    alone = [EngineCore(engine(tiny, "torch"), 256, CoreConfig(max_len=96)) for _ in range(3)]
    want = [run_core(c, [request(tiny, "torch", i, "early", sampling[i])])[0].token_ids for i, c in enumerate(alone)]
    core = EngineCore(engine(tiny, "torch"), 256, CoreConfig(slots=3, max_len=96))
    out = run_core(core, [request(tiny, "torch", i, "early", sampling[i]) for i in range(3)])
    assert [out[i].token_ids for i in range(3)] == want


def test_cancel_frees_the_slot_and_a_full_queue_refuses(tiny):
    core = EngineCore(engine(tiny, "torch"), 256, CoreConfig(slots=1, max_len=96, max_queue=1))
    first = core.add(request(tiny, "torch", 0, "ngram"))
    second = core.add(request(tiny, "torch", 1, "plain"))
    with pytest.raises(QueueFull, match="1 requests wait"):
        core.add(request(tiny, "torch", 2, "plain"))
    core.step()
    core.step()
    assert core.pool.in_use == 1 and first.take() and not second.take()  # the second waits for the slot
    first.cancelled = True
    assert core.step() == [first] and first.result().stop_reason == "cancelled"
    while not second.finished:
        core.step()
    assert second.result().token_ids == generate(engine(tiny, "torch"), PROMPTS[1],
                                                 GenerateConfig(max_new_tokens=LENGTHS[1]), frozenset()).token_ids
    assert core.pool.in_use == 0 and core.idle


def test_a_request_too_long_for_a_slot_is_refused_with_the_fix(tiny):
    core = EngineCore(engine(tiny, "torch"), 256, CoreConfig(slots=1, max_len=40))
    with pytest.raises(UserError, match="shorten it"):
        core.add(request(tiny, "torch", 4, "ngram"))
    assert core.idle


def test_steps_the_draft_switch_turns_off_decode_plain_and_stay_lossless(tiny, monkeypatch):
    """With the switch measuring proposing steps as slower, only its probe steps (every PROBE_EVERY-th) propose;
    the tokens stay plain greedy decoding's. (The switch decides from 2 requests here, SWITCHED patched: the test
    has 5.)"""
    from spork_trt.spec import draft_switch
    from spork_trt.spec.draft_switch import PROBE_EVERY

    monkeypatch.setattr(draft_switch, "SWITCHED", 2)

    want = [generate(engine(tiny, "torch"), PROMPTS[i], GenerateConfig(max_new_tokens=LENGTHS[i]), frozenset()).token_ids
            for i in range(5)]
    core = EngineCore(engine(tiny, "torch"), 256, CoreConfig(slots=5, max_len=96))
    core.switch.sums = {(k, True): [1.0, 1.0] for k in range(4)} | {(k, False): [2.0, 1.0] for k in range(4)}
    core.switch.record = lambda *a: None  # keep the measurement
    reqs = [request(tiny, "torch", i, "ngram") for i in range(5)]
    calls = []
    for r in reqs:
        r.drafter.propose = lambda root, spec, f=r.drafter.propose: calls.append(
            (core.switch.steps, len(core.active))) or f(root, spec)
    out = run_core(core, reqs)
    assert [out[i].token_ids for i in range(5)] == want
    assert any(n > 1 for _, n in calls)  # probe steps only, or one request left (it always proposes)
    assert all(step % PROBE_EVERY == 0 or n == 1 for step, n in calls)


@pytest.mark.parametrize("kind", ["onnx", "torch"])
def test_a_joining_request_rides_in_the_step_s_one_target_forward(tiny, kind):
    """Steps in which requests decode while another's prompt is prefilled in chunks run ONE target forward on a
    packing engine (the default ONNX GQA graph): the prompt chunks ride with the trees, within one token budget;
    a padded engine (torch: a batch costs B x T) runs the chunks in a second one. Every request still gets its
    plain greedy tokens."""
    want = [generate(engine(tiny, kind), PROMPTS[i], GenerateConfig(max_new_tokens=LENGTHS[i]), frozenset()).token_ids
            for i in range(3)]
    eng = engine(tiny, kind)
    core = EngineCore(eng, 256, CoreConfig(slots=3, max_len=96, prefill_tokens=3, step_tokens=24))
    calls, forward_batch = [], eng.forward_batch
    eng.forward_batch = lambda seqs, hidden=None: calls.append(len(seqs)) or forward_batch(seqs, hidden)
    reqs = [request(tiny, kind, i, d) for i, d in enumerate(["ngram", "plain", "ngram"])]
    per_step, mixed, out, steps = [], 0, {}, 0
    for i in (0, 1):
        core.add(reqs[i])
    while not core.idle or steps < 6:
        if steps == 6:
            core.add(reqs[2])  # PROMPTS[2]: 15 tokens, 5 chunks of 3 while the first two decode
        joining = any(r.root is None for r in core.active) or bool(core.waiting)
        decoding = sum(r.root is not None for r in core.active)
        before = len(calls)
        for r in core.step():
            out[reqs.index(r.sub)] = r.result()
        per_step.append(len(calls) - before)
        mixed += joining and decoding > 0
        steps += 1
    assert [out[i].token_ids for i in range(3)] == want
    assert mixed >= 5  # the third prompt's chunks all ran while others decoded
    assert max(per_step) == (1 if kind == "onnx" else 2)
