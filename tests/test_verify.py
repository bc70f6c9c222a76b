"""Verification tables with hand-made logits, tree compilation, and a statistical test that speculative sampling
reproduces the target distribution for chains and trees."""
from __future__ import annotations

import pytest
import torch

from spork_trt.spec.tree import PRESETS, DraftTree, chain_parents, choices_to_parents, compile_tree
from spork_trt.spec.verification import verify_greedy, verify_sampling

V = 6


def logits_for(best: list[int]) -> torch.Tensor:
    """[N, V] logits whose argmax at node i is best[i]."""
    out = torch.zeros(len(best), V)
    for i, b in enumerate(best):
        out[i, b] = 5.0
    return out


def greedy(tokens, parents, best):
    tree = DraftTree(tuple(tokens), tuple(parents))
    return verify_greedy(tree, compile_tree(tree.parents, 3).children, logits_for(best))


def test_full_match():
    v = greedy([0, 1, 2, 3], chain_parents(3), [1, 2, 3, 4])
    assert v.path == (0, 1, 2, 3) and v.accepted == (1, 2, 3) and v.bonus == 4


def test_early_mismatch():
    v = greedy([0, 1, 2, 3], chain_parents(3), [1, 5, 3, 4])
    assert v.path == (0, 1) and v.accepted == (1,) and v.bonus == 5


def test_first_token_rejected():
    v = greedy([0, 1, 2], chain_parents(2), [4, 2, 3])
    assert v.path == (0,) and v.accepted == () and v.bonus == 4


def test_non_first_fork_accepted():
    # root -> {1 (node 1), 2 (node 2)}; node 2 -> 3 (node 3); the target wants 2 then 3 then 5
    v = greedy([0, 1, 2, 3], [-1, 0, 0, 2], [2, 0, 3, 5])
    assert v.path == (0, 2, 3) and v.accepted == (2, 3) and v.bonus == 5


def test_empty_draft():
    v = greedy([0], [-1], [4])
    assert v.path == (0,) and v.accepted == () and v.bonus == 4


def test_compile_tree_mask_positions_children():
    parents = (-1, 0, 0, 1, 3)
    b = compile_tree(parents, prefix_len=2)
    assert b.mask.shape == (1, 5, 7)
    assert b.mask[0, :, :2].all()  # everyone sees the prefix
    assert b.mask[0, 4, 2:].tolist() == [True, True, False, True, True]  # node 4: root, 1, 3, itself
    assert b.mask[0, 2, 2:].tolist() == [True, False, True, False, False]
    assert b.position_ids.tolist() == [[2, 3, 3, 4, 5]] and b.depth == (0, 1, 1, 2, 3)
    assert b.children == ((1, 2), (3,), (), (4,), ())
    chain = compile_tree(chain_parents(3), 0)  # a chain is a tree: its mask is causal
    assert torch.equal(chain.mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_static_presets_compile_through_the_same_function():
    for name, choices in PRESETS.items():
        parents, order = choices_to_parents(choices)
        b = compile_tree(parents, 0)
        assert max(b.depth) == max(len(c) for c in choices), name
        for i, c in enumerate(order, start=1):
            assert b.depth[i] == len(c)
    with pytest.raises(ValueError, match="no parent"):
        choices_to_parents([(0, 1)])


# ---- sampling: the committed token distribution equals the target's ------------------------------------------

def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Chi-square goodness of fit at p ~ 1e-4 (critical values for small dof), over cells with mass."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    critical = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7}[dof]
    return stat < critical and counts[~keep].sum() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_sampling_first_token_follows_the_target(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)  # target at the root
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)  # the draft's distribution
    counts = torch.zeros(V)
    n = 6000
    for _ in range(n):
        # draw two children without replacement from q, as the model drafter does
        q1 = q.clone()
        x1 = int(torch.multinomial(q1, 1, generator=g))
        q2 = q1.clone()
        q2[x1] = 0
        q2 /= q2.sum()
        x2 = int(torch.multinomial(q2, 1, generator=g))
        tree = DraftTree((0, x1, x2), (-1, 0, 0), torch.stack([q, q1, q2]))
        probs = torch.stack([p, p, p])
        v = verify_sampling(tree, compile_tree(tree.parents, 0).children, probs, g)
        first = v.accepted[0] if v.accepted else v.bonus
        counts[first] += 1
    assert chi_square_ok(counts, p)


@pytest.mark.parametrize("seed", [3, 4])
def test_speculative_sampling_two_token_joint_follows_the_target_on_a_chain_with_deterministic_drafts(seed):
    g = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(V, generator=g), -1)
    p_next = torch.softmax(torch.randn(V, V, generator=g), -1)  # p(second | first)
    counts = torch.zeros(V * V)
    for _ in range(8000):
        # a deterministic drafter (top-1 guesses, one-hot proposals): chain root -> 2 -> 3, plus a fork root -> 4
        tree = DraftTree((0, 2, 3, 4), (-1, 0, 1, 0))
        probs = torch.stack([p_root, p_next[2], p_next[3], p_next[4]])
        v = verify_sampling(tree, compile_tree(tree.parents, 0).children, probs, g)
        seq = list(v.accepted) + [v.bonus]
        if len(seq) == 1:  # only the bonus: the second token would come from the next step's target
            seq.append(int(torch.multinomial(p_next[seq[0]], 1, generator=g)))
        counts[seq[0] * V + seq[1]] += 1
    joint = (p_root[:, None] * p_next).flatten()
    expected = joint * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 75.0  # chi-square, 35 dof, p ~ 1e-4
