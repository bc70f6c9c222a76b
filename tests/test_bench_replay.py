"""`bench replay`: replaying a drafter over the target's greedy answer gives the engine core's own steps (the fixed
shape, where no timing decides anything), and the cost curves and shapes parse or fail clearly."""
from __future__ import annotations

import pytest

from bench.replay import Replayed, cost_curve, replay, shapes, subset
from spork_trt.config import SpecConfig
from spork_trt.spec.datastore import SEP, Datastore
from spork_trt.errors import UserError
from tests.test_spork_keystone import PROMPTS, drafter_for, run, target  # noqa: F401 (the module's fixture)


@pytest.mark.parametrize("kind", ["ngram", "store"])
@pytest.mark.parametrize("width,depth", [(1, 4), (3, 5)])
def test_fixed_shape_replay_takes_the_engine_cores_steps(target, kind, width, depth):  # noqa: F811
    spec = SpecConfig(tree_width=width, tree_depth=depth, tree_budget=width * depth, adaptive=False)
    accepted = 0
    for prompt in PROMPTS:
        answer = run(target, prompt, 40).token_ids
        st = run(target, prompt, 40, drafter_for(kind, target), spec).stats
        r = replay(drafter_for(kind, target), spec, prompt, answer, cost_curve(None))
        # the engine core counts the prefill's token as a step of its own
        assert (r.steps + 1, r.tokens + 1, r.nodes) == (st.steps, st.committed_tokens, st.draft_tokens), prompt
        assert r.cost == pytest.approx(r.steps + 0.08 * r.nodes)  # the prior: 8% more per extra token
        accepted += r.tokens - r.steps
    assert accepted > 0  # drafts were accepted: the replay followed real trees, not plain steps alone


def test_replay_of_a_perfect_store_accepts_whole_chains():
    answer = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    store = Datastore.build([[1, 2, 3, 4, *answer]])
    from spork_trt.spec.drafters import NgramDrafter, StoreDrafter

    spec = SpecConfig(tree_width=1, tree_depth=4, tree_budget=4, adaptive=False)
    r = replay(StoreDrafter(NgramDrafter(4), store), spec, [1, 2, 3, 4], answer, cost_curve("1:1,5:2"))
    # 4 accepted + the bonus (5 tokens of forward: cost 2), then the 3 left, accepted (cost 1.75)
    assert r == Replayed(steps=2, tokens=8, nodes=7, cost=3.75)


def test_cost_curves_and_shapes_parse_or_say_how():
    gpu = cost_curve("1:2.2,16:3.0,64:3.1")
    assert gpu(1) == 1.0 and gpu(16) == pytest.approx(3.0 / 2.2) and gpu(128) > gpu(64)
    assert cost_curve(None)(11) == pytest.approx(1.8)
    for bad in ("16:3.0,64:3.1", "1:2", "1:x,2:3", "1:0,4:1"):
        with pytest.raises(UserError, match="N:S pairs"):
            cost_curve(bad)
    assert shapes("default,8x8x64") == [None, (8, 8, 64)]
    with pytest.raises(UserError, match="KxMxN"):
        shapes("8x8")


def test_a_store_subset_keeps_whole_sequences():
    seqs = [[i, i + 1, i + 2] for i in range(0, 300, 3)]
    small = subset(Datastore.build(seqs), 0.25)
    kept = [s for s in small.tokens.tolist() if s != SEP]
    assert len(kept) == 75 and sorted(kept) == kept  # 25 whole sequences, in corpus order
