"""The learned draft head drafting (`--draft eagle`) on a tiny random target with a head trained on its own text:
spork == plain token for token (every shape, adaptive on and off), the head's drafts are accepted far more often
than chance, requests batched in the engine core equal each alone, the ONNX target's hidden-state output equals
the reference's, the head's ONNX step equals it in PyTorch, and a seeded sampled request draws the same tokens
every time."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.spec.draft_head import load_head
from spork_trt.spec.eagle import EagleDrafter, lookup
from spork_trt.engines import chain_input
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.learn.train_draft import TrainConfig, train_draft
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.loop.request import Submission
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import onnx_head_step_matching, run_core, tiny_config, write_selfdata

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 3, 3, 17, 22, 9], [5] * 3 + [6, 7] * 5]


@pytest.fixture(scope="module")
def target():
    return random_checkpoint(tiny_config(vocab_size=48, n_layers=3), seed=11, scale=8.0).model


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle")
    cfg = TrainConfig(data=write_selfdata(target, d), out=d / "head", vocab=40, steps=2, epochs=4, lr=1e-2, batch=8,
                      seed=1)
    train_draft(cfg, target)
    return load_head(d / "head" / "head.safetensors")[0]


def drafter(head, target, sampling=GREEDY, seed=0) -> EagleDrafter:
    return EagleDrafter(head, lookup(target.embed.weight.detach()), sampling, torch.Generator().manual_seed(seed))


def run(engine, prompt, n, d=None, spec=SpecConfig(), sampling=GREEDY):
    return generate(engine, prompt, GenerateConfig(max_new_tokens=n, sampling=sampling), frozenset(), drafter=d,
                    spec=spec)


@pytest.mark.parametrize("width,depth", [(1, 1), (1, 4), (2, 3), (3, 5), (4, 2)])
def test_eagle_greedy_equals_plain(target, head, width, depth):
    engine = TorchEngine(target, taps=head.hc.taps)
    for adaptive in (True, False):
        spec = SpecConfig(draft="eagle", tree_width=width, tree_depth=depth, tree_budget=max(1, width * depth - 1),
                          adaptive=adaptive)
        for prompt in PROMPTS:
            got = run(engine, prompt, 40, drafter(head, target), spec)
            assert got.token_ids == run(TorchEngine(target), prompt, 40).token_ids, (width, depth, adaptive, prompt)


def test_drafts_are_the_heads_teacher_forced_predictions(target, head):
    """At every step the depth-1 draft is what the head predicts over the finished text with the target's own
    features (as train-draft evaluates it): the drafter feeds the head exactly what training showed it."""
    prompt = PROMPTS[0]
    out = run(TorchEngine(target), prompt, 60).token_ids
    s = prompt + out
    with torch.no_grad():
        o = target(torch.tensor([s]), torch.arange(len(s))[None], causal_mask(0, len(s)), taps=head.hc.taps)
        n = len(s) - 1
        _, logits = head(target.embed(torch.tensor([s[1:]])), head.fuse(o.hidden)[:, :n], torch.arange(n)[None],
                         causal_mask(0, n))
    forced = head.d2t[logits[0].argmax(-1)].tolist()  # forced[p] predicts s[p + 2]
    d, seen = drafter(head, target), []
    propose = d.propose
    d.propose = lambda root, spec: seen.append((len(d.tokens), propose(root, spec))) or seen[-1][1]
    spec = SpecConfig(draft="eagle", tree_width=1, tree_depth=1, tree_budget=1, adaptive=False)
    assert run(TorchEngine(target, taps=head.hc.taps), prompt, 60, d, spec).token_ids == out
    assert len(seen) > 20 and all(tree.tokens[1] == forced[m - 1] for m, tree in seen)  # root s[m]: drafts s[m+1]
    assert sum(tree.tokens[1] == s[m + 1] for m, tree in seen if m + 1 < len(s)) > len(seen) / 10  # chance: 1/48


def test_batched_eagle_requests_equal_each_alone(target, head):
    """Eagle and plain requests on three slots with small prefill chunks: the target's hidden states reach each
    request's head from the batched forwards (prompt chunks and trees), and every output equals plain alone."""
    engine = TorchEngine(target, taps=head.hc.taps)
    core = EngineCore(engine, 256, CoreConfig(slots=3, max_len=128, prefill_tokens=5))
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5)
    reqs = [Submission(p, GenerateConfig(max_new_tokens=30), spec=spec,
                       drafter=drafter(head, target) if i != 1 else None) for i, p in enumerate(PROMPTS + [[9, 9, 8]])]
    out = run_core(core, reqs)
    for i, p in enumerate(PROMPTS + [[9, 9, 8]]):
        assert out[i].token_ids == run(TorchEngine(target), p, 30).token_ids


def test_onnx_target_outputs_the_reference_hidden_states(target, head, tmp_path):
    path = export_onnx(target, tmp_path / "target.onnx", taps=head.hc.taps)
    onnx, ref = OnnxEngine(path, target.cfg, taps=head.hc.taps), TorchEngine(target, taps=head.hc.taps)
    got, want = [], []
    for eng, out in ((onnx, got), (ref, want)):
        pool = eng.make_pool(2, 32)
        eng.forward_batch([chain_input(pool.caches[0], PROMPTS[0], ()), chain_input(pool.caches[1], PROMPTS[1])],
                          out)
    for g, w, p in zip(got, want, PROMPTS):
        assert g.shape == (len(p), target.cfg.dim) and torch.allclose(g, w, atol=1e-4)
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5)
    assert run(onnx, PROMPTS[2], 30, drafter(head, target), spec).token_ids == run(ref, PROMPTS[2], 30).token_ids


def test_seeded_sampling_with_eagle_repeats(target, head):
    s = SamplingConfig(temperature=0.8, seed=7)
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5)
    engine = TorchEngine(target, taps=head.hc.taps)
    a = run(engine, PROMPTS[1], 40, drafter(head, target, s, 8), spec, s)
    b = run(engine, PROMPTS[1], 40, drafter(head, target, s, 8), spec, s)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40


def test_onnx_head_step_equals_the_torch_head(target, head, tmp_path):
    """head.onnx (what `export build` writes) gives the torch head's outputs and new KV rows over
    a cache, and the drafter with it drafts the same trees: spork == plain, the same drafts as in PyTorch."""
    step = onnx_head_step_matching(head, tmp_path)
    # a fixed tree shape: the adaptive scheduler's choices depend on timing, which differs between two runs
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5, adaptive=False)
    engine = TorchEngine(target, taps=head.hc.taps)
    trees = {}
    for name, s in (("torch", None), ("onnx", step)):
        d = drafter(head, target)
        d.step, propose, trees[name] = s, d.propose, []
        d.propose = lambda root, spec, d=d, propose=propose, seen=trees[name]: seen.append(propose(root, spec)) \
            or seen[-1]
        assert run(engine, PROMPTS[2], 30, d, spec).token_ids == run(TorchEngine(target), PROMPTS[2], 30).token_ids
    assert len(trees["onnx"]) > 3 and [t.tokens for t in trees["onnx"]] == [t.tokens for t in trees["torch"]]


def test_graft_adds_the_other_trees_new_nodes_under_their_parents():
    from spork_trt.spec.tree import DraftTree, graft

    head_tree = DraftTree((7, 1, 2, 3), (-1, 0, 1, 0), score=(1.0, 0.6, 0.3, 0.2))  # 7 -> 1 -> 2, 7 -> 3
    store_tree = DraftTree((7, 1, 4, 5, 6), (-1, 0, 1, 0, 3), score=(1.0, 0.5, 0.5, 0.25, 0.25))  # 1 -> 4, 5 -> 6
    got = graft(head_tree, store_tree, budget=10)
    assert got.tokens == (7, 1, 2, 3, 4, 5, 6) and got.parents == (-1, 0, 1, 0, 1, 0, 5)
    assert got.score == (1.0, 0.6, 0.3, 0.2, 0.5, 0.25, 0.25)  # the shared node 1 keeps the first tree's score
    assert got.source == (0, 0, 0, 0, 1, 1, 1)  # the added nodes are tagged as the second source
    # ... and keep their ranks in their own tree: 4 was the second's first choice under 1, 5 its second at the root
    # (its first, 1, merged into the first tree's node)
    assert got.ranks() == (0, 0, 0, 1, 0, 1, 0)
    cut = got.subtree([0, 1, 4, 5])
    assert cut.source == (0, 0, 1, 1) and cut.ranks() == (0, 0, 0, 1)  # a pruned sibling does not move a rank
    assert got.after([9]).source == (0, 0, 0, 0, 0, 1, 1, 1) and got.after([9]).ranks() == (0, 0, 0, 0, 1, 0, 1, 0)
    small = graft(head_tree, store_tree, budget=4)  # room for one more node: 4; then 5 does not fit, nor its child 6
    assert small.tokens == (7, 1, 2, 3, 4) and small.parents == (-1, 0, 1, 0, 1)


def test_store_eagle_greedy_equals_plain_and_uses_both_drafters(target, head, tmp_path):
    """`--draft store-eagle`: the store's tree alone where it matches long, the head's with the store's forks grafted
    on otherwise; lossless either way, alone and batched, and both branches occur."""
    from spork_trt.spec.datastore import Datastore
    from spork_trt.spec.drafters import NgramDrafter, StoreDrafter
    from spork_trt.spec.eagle import StoreHeadDrafter

    store = Datastore.build([p + run(TorchEngine(target), p, 40).token_ids for p in ([3, 1, 4], [2, 7, 1, 8])])
    trees = {"store": 0, "head": 0}

    def hybrid():
        d = StoreHeadDrafter(StoreDrafter(NgramDrafter(4), store), drafter(head, target),
                             SpecConfig.for_draft("eagle"), min_match=3)
        propose = d.head.propose
        d.head.propose = lambda root, spec: trees.__setitem__("head", trees["head"] + 1) or propose(root, spec)
        store_propose = d.store.propose

        def counted(root, spec):
            t = store_propose(root, spec)
            trees["store"] += max(t.score[1:], default=0) * 4 >= 3
            return t
        d.store.propose = counted
        return d

    engine = TorchEngine(target, taps=head.hc.taps)
    spec = SpecConfig.for_draft("store-eagle")
    prompts = PROMPTS + [[3, 1, 4], [2, 7, 1, 8, 5]]  # the last two: their text is in the store
    for p in prompts:
        assert run(engine, p, 40, hybrid(), spec).token_ids == run(TorchEngine(target), p, 40).token_ids, p
    assert trees["store"] > 0 and trees["head"] > 0, trees
    core = EngineCore(engine, 256, CoreConfig(slots=3, max_len=128, prefill_tokens=5))
    out = run_core(core, [Submission(p, GenerateConfig(max_new_tokens=30), spec=spec, drafter=hybrid())
                          for p in prompts])
    for i, p in enumerate(prompts):
        assert out[i].token_ids == run(TorchEngine(target), p, 30).token_ids


def test_store_eagle_head_drafts_no_deeper_than_the_schedulers_depth():
    """Where the store matches weakly the head drafts with its own shape, cut to the scheduler's current depth (halved
    after failed steps), and its nodes come tagged as the second source."""
    from types import SimpleNamespace

    from spork_trt.spec.eagle import StoreHeadDrafter
    from spork_trt.spec.tree import DraftTree

    asked = []
    store = SimpleNamespace(ngram=SimpleNamespace(max_n=4),
                            propose=lambda root, spec: DraftTree((root, 5), (-1, 0), score=(1.0, 0.25)))
    head = SimpleNamespace(sampling=SamplingConfig(), propose=lambda root, spec: asked.append(spec.tree_depth)
                           or DraftTree((root, 6), (-1, 0), score=(1.0, 0.9)))
    d = StoreHeadDrafter(store, head, SpecConfig.for_draft("eagle"), min_match=3)
    for depth in (6, 2, 1):
        tree = d.propose(1, SpecConfig.for_draft("store-eagle", depth=depth))
        assert tree.tokens == (1, 5, 6) and tree.source == (0, 0, 1) and tree.ranks() == (0, 0, 0)
    assert asked == [SpecConfig.for_draft("eagle").tree_depth, 2, 1]
