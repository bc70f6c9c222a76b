"""The score step on tiny random models: verifier pruning stays lossless, the verifier leaves the target's cache as
it found it, gate mode's deferred target rows are right, the head fits and round-trips, the metrics are right,
and the scheduler moves tau and switches a verifier that does not pay off (and probes it again)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.spec.drafters import ModelDrafter, NgramDrafter
from spork_trt.engines import prefill
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import UserError
from spork_trt.learn.calibrate import auroc, ece, ece_floor
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.quant_copies import int8_copy
from spork_trt.spec.scheduler import Scheduler
from spork_trt.spec.verifier_policy import FIRST_PROBE, PROBE_EVERY
from spork_trt.spec.tree import DraftTree, compile_tree
from spork_trt.spec.verifier import (
    FEATURES,
    ConfidenceHead,
    Verifier,
    fit_head,
    gate_path,
    head_file,
    load_heads,
    survival,
)
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

GREEDY = SamplingConfig()
F = len(FEATURES)


@pytest.fixture(scope="module")
def target():
    return random_checkpoint(tiny_config(vocab_size=48, n_layers=3), seed=11, scale=8.0).model


def head(weights: dict[str, float], bias: float, layers: int) -> ConfidenceHead:
    return ConfidenceHead(tuple(weights.get(f, 0.0) for f in FEATURES), bias, (0.0,) * F, (1.0,) * F, layers)


def argmax_head(layers: int) -> ConfidenceHead:
    """Confidence ~1 for the verifier's own top token, ~0 otherwise."""
    return head({"is_top": 20.0}, -10.0, layers)


def run(target, prompt, n, drafter=None, spec=SpecConfig(), verifier=None, record=False):
    cfg = GenerateConfig(max_new_tokens=n, sampling=GREEDY)
    return generate(TorchEngine(target), prompt, cfg, frozenset(), drafter=drafter, spec=spec, verifier=verifier,
                    record=record)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 3, 3, 17, 22, 9], [5] * 3 + [6, 7] * 5]


@pytest.mark.parametrize("kind", ["ngram", "self-int8"])
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_verifier_pruning_stays_lossless(target, kind, adaptive, tau):
    hd = head({"logp": 0.8, "depth_1": 1.0, "rank_0": 1.0}, 0.5, 1)  # some head; losslessness must not care
    for prompt in PROMPTS:
        drafter = NgramDrafter(4) if kind == "ngram" else ModelDrafter(
            TorchEngine(int8_copy(target)), GREEDY, torch.Generator().manual_seed(0))
        spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=10, adaptive=adaptive, verifier="on", tau=tau)
        got = run(target, prompt, 40, drafter, spec, Verifier(TorchEngine(target, exit_layer=1), hd))
        assert got.token_ids == run(target, prompt, 40).token_ids, (kind, adaptive, tau, prompt)
        assert got.stats.scored_steps > 0


def test_verifier_leaves_the_target_cache_as_it_found_it(target):
    eng = TorchEngine(target)
    rows = eng.make_cache(64)
    prefill(eng, rows, PROMPTS[0])
    k_before = rows.k.clone()
    tree = DraftTree((9, 4, 5, 6), (-1, 0, 0, 1))
    v = Verifier(TorchEngine(target, exit_layer=2), argmax_head(2))
    scored = v.score(rows, [], tree)
    assert (rows.length, rows.pending) == (len(PROMPTS[0]), 0)
    assert torch.equal(rows.k[:, :, :, :rows.length], k_before[:, :, :, :rows.length])
    assert scored.features.shape == (4, F) and scored.depth == (0, 1, 1, 2)
    assert scored.survival[3] == pytest.approx(scored.confidence[1] * scored.confidence[3])
    # the verifier's features at a node come from its logits at the node's parent, the same as running it alone
    alone = TorchEngine(target, exit_layer=2)
    own = alone.make_cache(64)
    prefill(alone, own, PROMPTS[0])
    buf = compile_tree(tree.parents, own.length)
    logits = alone.forward(own, torch.tensor([tree.tokens]), buf.position_ids, buf.mask)[0]
    lp = torch.log_softmax(logits, -1)
    assert scored.features[1, FEATURES.index("logp")] == pytest.approx(float(lp[0, 4]), abs=1e-4)
    assert scored.features[3, FEATURES.index("logp")] == pytest.approx(float(lp[1, 6]), abs=1e-4)


@pytest.mark.parametrize("kind", ["ngram", "perfect"])
def test_gate_with_an_exact_verifier_equals_plain(target, kind):
    """A verifier that is the whole target and trusts only its own argmax gates exactly the greedy tokens, so gate
    mode must reproduce plain greedy: this checks the deferred target rows (tokens committed without a target
    pass are run ahead of the next tree)."""
    verifier = Verifier(TorchEngine(target, exit_layer=target.cfg.n_layers), argmax_head(target.cfg.n_layers))
    spec = SpecConfig(tree_width=2, tree_depth=4, tree_budget=8, gate_tau=0.5)
    for prompt in PROMPTS:
        drafter = NgramDrafter(4) if kind == "ngram" else ModelDrafter(
            TorchEngine(target), GREEDY, torch.Generator().manual_seed(0))
        got = run(target, prompt, 50, drafter, spec, verifier)
        assert got.token_ids == run(target, prompt, 50).token_ids, (kind, prompt)
        if kind == "perfect":
            assert got.stats.gated_tokens > 25  # most tokens never needed a verify pass of their own


def test_gate_path_follows_the_most_confident_child():
    tree = DraftTree((0, 1, 2, 3, 4), (-1, 0, 0, 1, 2))

    class S:
        survival = np.array([1.0, 0.9, 0.6, 0.4, 0.55])

    assert gate_path(tree, S, 0.5) == [1]  # child 1 (0.9) beats 2; its child 3 falls below tau
    assert gate_path(tree, S, 0.3) == [1, 3]
    assert gate_path(tree, S, 0.95) == []


def test_fit_head_learns_a_signal_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8000, F))
    p = 1 / (1 + np.exp(-(2.0 * x[:, 0] - 1.0 * x[:, 2])))
    y = (rng.random(8000) < p).astype(float)
    hd = fit_head(x[:4000], y[:4000], verifier_layers=4, meta={"fitted_on": "synthetic"})
    q = hd(x[4000:])
    assert auroc(q, y[4000:]) > 0.8 and ece(q, y[4000:]) < 0.03  # the floor on 4000 nodes is about 0.015
    back = ConfidenceHead.load(hd.save(tmp_path / "h.json"))
    assert np.allclose(back(x[:5]), hd(x[:5])) and back.meta == {"fitted_on": "synthetic"}
    (tmp_path / "bad.json").write_text('{"format_version": 1, "features": ["x"]}')
    with pytest.raises(UserError, match="calibrate"):
        ConfidenceHead.load(tmp_path / "bad.json")
    with pytest.raises(UserError, match="both accepted and rejected"):
        fit_head(x[:50], np.ones(50), 4)


def test_heads_are_kept_per_drafter(tmp_path):
    """One head file per drafter (file-safe names), found by the drafter each was fitted on; an older single
    confidence_head.json counts as the n-gram drafter's; a head for another verifier depth is refused."""
    assert head_file("model:/a/b.gguf") == "confidence_head-model__a_b.gguf.json"
    assert head_file("early-exit:8") == "confidence_head-early-exit_8.json"
    for draft, bias in (("self-int8", 1.0), ("early-exit:8", 2.0)):
        ConfidenceHead((0.0,) * F, bias, (0.0,) * F, (1.0,) * F, 4, {"draft": draft}).save(tmp_path / head_file(draft))
    head({}, 3.0, 4).save(tmp_path / "confidence_head.json")  # no meta: written before heads were per drafter
    heads = load_heads(tmp_path, 4)
    assert {k: h.bias for k, h in heads.items()} == {"self-int8": 1.0, "early-exit:8": 2.0, "ngram": 3.0}
    ConfidenceHead((0.0,) * F, 4.0, (0.0,) * F, (1.0,) * F, 4, {"draft": "ngram"}).save(tmp_path / head_file("ngram"))
    assert load_heads(tmp_path, 4)["ngram"].bias == 4.0  # the per-drafter file wins over the older single one
    with pytest.raises(UserError, match="4-layer verifier, this build has 8"):
        load_heads(tmp_path, 8)


def test_metrics_on_hand_made_values():
    y = np.array([0, 0, 1, 1.0])
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auroc(np.array([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auroc(np.array([0.5, 0.5, 0.5, 0.5]), y) == 0.5
    assert auroc(np.array([0.5, 0.5]), np.array([1.0, 1.0])) is None
    assert ece(np.array([0.25, 0.25, 0.75, 0.75]), np.array([0, 1, 1, 0.0])) == pytest.approx(0.25)
    assert ece(np.array([0.05, 0.05, 0.95, 0.95]), np.array([0, 0, 1, 1.0])) == pytest.approx(0.05)


def test_ece_floor_is_the_sampling_noise_of_a_calibrated_head():
    p = np.random.default_rng(1).uniform(0.2, 0.9, 300)
    floor = ece_floor(p)
    assert floor == ece_floor(p)  # seeded: a report is reproducible
    assert 0.03 < floor < 0.08  # a few hundred nodes: noise alone is near the 0.05 goal
    assert ece_floor(np.tile(p, 30)) < floor / 4  # about 1 / sqrt(n)
    assert ece_floor(np.full(300, 1.0)) == 0.0  # certain labels carry no noise


def test_survival_is_the_product_along_the_path():
    s = survival((-1, 0, 1, 0, 3), np.array([1.0, 0.5, 0.5, 0.8, 0.5]))
    assert np.allclose(s, [1.0, 0.5, 0.25, 0.8, 0.4])


def test_scheduler_tau_follows_the_acceptance_target_and_auto_turns_an_unpaying_verifier_off():
    sched = Scheduler(SpecConfig(verifier="auto", tau=0.1, target_acceptance=0.7))
    vs = sched.verifier
    sched.costs.set({0: 0.010, 3: 0.0101})  # verify cost flat in tree size: pruning saves nothing
    tree = DraftTree(tuple(range(8)), (-1, 0, 1, 2, 0, 4, 5, 6))
    assert [vs.use(True) for _ in range(FIRST_PROBE)] == [False] * (FIRST_PROBE - 1) + [True]
    keep = sched.prune(tree, True, np.array([1, .9, .8, .05, .3, .2, .1, .01]))
    assert 0 in keep and 7 not in keep and all(tree.parents[i] in keep for i in keep if i)
    vs.scored(score_s=0.004, acceptance=0.2, n=len(keep))
    assert vs.tau > 0.1  # acceptance below target: prune harder
    assert not vs.on and vs.offs == 1  # 4 ms spent to save ~0
    assert [vs.use(True) for _ in range(2 * PROBE_EVERY)] == [False] * (2 * PROBE_EVERY - 1) + [True]
    sched.costs.set({0: 0.01, 1: 0.02, 2: 0.1, 3: 0.2})  # verify cost now steep in tree size: pruning pays
    vs.baseline_n = 8  # what pruning by (depth, rank) alone would have verified; the verifier kept 2
    vs.scored(score_s=0.001, acceptance=0.6, n=2)
    assert vs.on and vs.probe_every == PROBE_EVERY and vs.use(True)
    assert not vs.use(False)  # no calibrated head: never
    forced = Scheduler(SpecConfig(verifier="on"))
    forced.verifier.scored(score_s=1.0, acceptance=0.0, n=2)
    assert forced.verifier.use(True)  # "on" stays on whatever it costs


def test_tree_after_a_chain():
    t = DraftTree((7, 8, 9), (-1, 0, 0)).after([3, 4])
    assert t.tokens == (3, 4, 7, 8, 9) and t.parents == (-1, 0, 1, 2, 2)
    buf = compile_tree(t.parents, 5)
    assert buf.position_ids.tolist() == [[5, 6, 7, 8, 8]]


def test_observed_labels_count_every_accepted_token_once(target):
    """Calibration's labelling: each node whose parent was accepted is one example; the accepted ones are exactly
    the accepted draft tokens."""
    seen = {"pos": 0, "n": 0}
    spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=10, adaptive=False, verifier="on")
    got = run(target, PROMPTS[2], 60, NgramDrafter(4), spec, Verifier(TorchEngine(target, exit_layer=1), None),
              record=True)
    for step in got.verified:
        on_path = set(step.verdict.path)
        for i in range(1, len(step.tree)):
            if step.tree.parents[i] in on_path:
                seen["n"] += 1
                seen["pos"] += i in on_path
    assert seen["pos"] == got.stats.accepted_tokens > 0 and seen["n"] > seen["pos"]


def test_batched_scoring_equals_scoring_alone_and_stays_lossless(target):
    """score_batch scores several requests' trees (each after its own committed rows, with its own head) in one
    verifier forward, with the features each gets alone, leaving every cache as it was; the engine core scores a
    step's trees that way (one shared verifier engine) and every request stays token-identical to plain."""
    from spork_trt.loop.engine_core import CoreConfig, EngineCore
    from spork_trt.loop.request import Submission
    from spork_trt.spec.verifier import ScoreJob, score_batch
    from tests.conftest import run_core

    shared = TorchEngine(target, exit_layer=2)
    calls = []
    forward_batch = shared.forward_batch
    shared.forward_batch = lambda seqs, *a: calls.append(len(seqs)) or forward_batch(seqs, *a)
    pool = TorchEngine(target).make_pool(3, 64)
    trees = [DraftTree((9, 4, 5, 6), (-1, 0, 0, 1)), DraftTree((3, 7), (-1, 0)), DraftTree((5,), (-1,))]
    for c, p in zip(pool.caches, PROMPTS):
        prefill(TorchEngine(target), c, p)
    heads = [argmax_head(2), head({"logp": 1.0}, 0.0, 2), None]
    jobs = [ScoreJob(Verifier(shared, h), c, [], t) for h, c, t in zip(heads, pool.caches, trees)]
    before = [c.k[:, :, :, :c.length].clone() for c in pool.caches]
    got = score_batch(jobs)
    assert calls == [3]
    for j, g, kb in zip(jobs, got, before):
        alone = Verifier(TorchEngine(target, exit_layer=2), j.verifier.head).score(j.rows, [], j.tree)
        assert np.allclose(g.features, alone.features, atol=1e-4) and g.depth == alone.depth
        assert (g.confidence is None) == (j.verifier.head is None)
        if g.confidence is not None:
            assert np.allclose(g.confidence, alone.confidence, atol=1e-4)
        assert (j.rows.pending, torch.equal(j.rows.k[:, :, :, :j.rows.length], kb)) == (0, True)

    calls.clear()
    spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=10, verifier="on", tau=0.05)
    core = EngineCore(TorchEngine(target), 256, CoreConfig(slots=3, max_len=128))
    reqs = [Submission(p, GenerateConfig(max_new_tokens=30), spec=spec, drafter=NgramDrafter(4),
                       verifier=Verifier(shared, argmax_head(2))) for p in PROMPTS]
    out = run_core(core, reqs)
    for i, p in enumerate(PROMPTS):
        assert out[i].token_ids == run(target, p, 30).token_ids and out[i].stats.scored_steps > 0
    assert max(calls) > 1  # steps scored several requests' trees in one forward
