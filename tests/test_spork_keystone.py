"""Keystone: spork greedy == plain greedy, token for token, for every drafter and tree shape (tiny random models).
Also: a perfect drafter (draft = target) gets every draft token accepted; a useless one changes nothing."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.spec.datastore import Datastore
from spork_trt.spec.drafters import HybridDrafter, ModelDrafter, NgramDrafter, StoreDrafter
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.quant_copies import int4_copy, int8_copy
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    # vocab 48 and sharp logits: random models then repeat themselves, so drafts are often partly right
    return random_checkpoint(tiny_config(vocab_size=48, n_layers=3), seed=11, scale=8.0).model


def drafter_for(kind: str, target):
    gen = torch.Generator().manual_seed(0)
    if kind == "ngram":
        return NgramDrafter(4)
    if kind == "store":  # a datastore of the target's own greedy text on other prompts (as self-data makes it)
        own = [p + run(target, p, 60).token_ids for p in ([9, 8, 7], [11, 12], [30, 31, 32, 33])]
        return StoreDrafter(NgramDrafter(4), Datastore.build(own))
    if kind == "hybrid":  # n-gram on repeats of 2+ tokens, else the INT4 copy drafting chains of 3
        model_spec = SpecConfig(tree_width=1, tree_depth=3, tree_budget=3)
        return HybridDrafter(NgramDrafter(4, 2), drafter_for("self-int4", target), model_spec)
    model = {
        "perfect": lambda: target,
        "self-int8": lambda: int8_copy(target),
        "self-int4": lambda: int4_copy(target),
        "useless": lambda: random_checkpoint(target.cfg, seed=99, scale=8.0).model,
    }.get(kind)
    engine = TorchEngine(target, exit_layer=1) if kind == "early-exit" else TorchEngine(model())
    # as the runtime does: self-drafts take the target's prompt rows ("perfect" and "useless" run the prompt)
    return ModelDrafter(engine, GREEDY, gen, share_prompt=kind in ("self-int8", "self-int4", "early-exit"))


def run(target, prompt, n, drafter=None, spec=SpecConfig()):
    cfg = GenerateConfig(max_new_tokens=n, sampling=GREEDY)
    return generate(TorchEngine(target), prompt, cfg, frozenset(), drafter=drafter, spec=spec)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 3, 3, 17, 22, 9], [5] * 3 + [6, 7] * 5]


@pytest.mark.parametrize("kind", ["ngram", "store", "hybrid", "self-int8", "self-int4", "early-exit", "perfect",
                                  "useless"])
@pytest.mark.parametrize("width,depth", [(1, 1), (1, 4), (1, 8), (2, 3), (3, 5), (4, 8), (4, 2)])
def test_spork_greedy_equals_plain_greedy(target, kind, width, depth):
    drafter = drafter_for(kind, target)
    for adaptive in (True, False):  # cost-aware pruning and depth changes on, and the fixed shape
        spec = SpecConfig(tree_width=width, tree_depth=depth, tree_budget=max(1, width * depth - 1), adaptive=adaptive)
        for prompt in PROMPTS:
            want = run(target, prompt, 40).token_ids
            got = run(target, prompt, 40, drafter, spec)
            assert got.token_ids == want, (kind, width, depth, prompt, adaptive)
            assert got.stats.committed_tokens == 40


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_perfect_drafter_gets_everything_accepted(target, depth):
    spec = SpecConfig(tree_width=1, tree_depth=depth, tree_budget=depth, adaptive=False)  # the fixed shape
    n = 12 * (depth + 1)
    st = run(target, PROMPTS[0], n, drafter_for("perfect", target), spec).stats
    # the first token comes from the prefill; every later step accepts `depth` draft tokens (+ 1 bonus)
    assert st.accepted_length_histogram == {0: 1, depth: st.steps - 1}
    assert st.acceptance_rate == 1.0 and st.mean_accepted_length == n / st.steps > depth


def test_perfect_drafter_tree_accepts_nearly_the_full_depth(target):
    # with forks, the K best nodes per depth by cumulative draft probability need not contain the greedy path
    # every time, but for a perfect drafter they nearly always do
    spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=12, adaptive=False)
    st = run(target, PROMPTS[0], 100, drafter_for("perfect", target), spec).stats
    assert st.mean_accepted_length > 4.0 and st.accepted_length_histogram[4] > (st.steps - 1) / 2


def test_useless_drafter_falls_back_to_plain_and_stays_exact(target):
    spec = SpecConfig(tree_width=1, tree_depth=4, tree_budget=4)
    got = run(target, PROMPTS[1], 60, drafter_for("useless", target), spec)
    assert got.token_ids == run(target, PROMPTS[1], 60).token_ids
    assert got.stats.acceptance_rate < 0.5


def test_stop_token_inside_an_accepted_path_truncates_there(target):
    plain = run(target, PROMPTS[0], 30).token_ids
    eos = plain[10]
    first = plain.index(eos)
    cfg = GenerateConfig(max_new_tokens=30, sampling=GREEDY)
    spec = SpecConfig(tree_width=1, tree_depth=6, tree_budget=6)
    got = generate(TorchEngine(target), PROMPTS[0], cfg, frozenset({eos}), drafter=drafter_for("perfect", target),
                   spec=spec)
    assert got.token_ids == plain[:first] and got.stop_reason == "eos"


def test_spork_sampling_matches_plain_sampling_in_distribution():
    """End to end through the loop: the tokens after the first (which the speculative steps produce) have the same
    distribution under spork as under plain sampling. Two-sample chi-square over the second token."""
    model = random_checkpoint(tiny_config(vocab_size=8, n_layers=2), seed=5, scale=20.0).model
    draft = random_checkpoint(tiny_config(vocab_size=8, n_layers=2), seed=6, scale=20.0).model
    spec = SpecConfig(tree_width=2, tree_depth=2, tree_budget=4)
    counts = {"plain": torch.zeros(8), "spork": torch.zeros(8)}
    n = 1500
    for arm in counts:
        for seed in range(n):
            s = SamplingConfig(temperature=1.0, seed=seed + (0 if arm == "plain" else 10**6))
            drafter = None
            if arm == "spork":
                drafter = ModelDrafter(TorchEngine(draft), s, torch.Generator().manual_seed(seed))
            out = generate(TorchEngine(model), [1, 2, 3], GenerateConfig(max_new_tokens=2, sampling=s), frozenset(),
                           drafter=drafter, spec=spec)
            counts[arm][out.token_ids[1]] += 1
    a, b = counts["plain"], counts["spork"]
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    stat = float(((a - b) ** 2 / (a + b)).sum())  # two-sample chi-square with equal sizes
    critical = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9, 7: 29.9}[int(keep.sum()) - 1]
    assert stat < critical, (counts, stat)
