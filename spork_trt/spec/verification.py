"""Tree verification: which draft tokens the target agrees with.

Glossary (DESIGN.md section 4):
  step        one iteration of the loop (propose, score, verify, commit)
  draft tokens  the tokens the drafter proposes in a step; they form a tree of nodes, each with a parent
  fork        a node with more than one child;  depth  distance from the committed frontier
  path        a root-to-node chain;  accepted  draft tokens on the longest path the target agrees with
  bonus       the target's own token after the accepted path (one per step: a step never yields zero tokens)
  committed   accepted + bonus; everything else is discarded

Greedy: follow, from the root, the child whose token equals the target's argmax at its parent.
Sampling: recursive rejection sampling over the children of each accepted node (SpecInfer-style multi-draft
speculative sampling). Child i, drawn from proposal q_i, is accepted with probability min(1, p_i(x) / q_i(x));
on rejection the target distribution becomes the residual p_{i+1} = norm(max(0, p_i - q_i)); when every child is
rejected the bonus is drawn from the last residual. Each stage outputs exactly p_i whatever the proposal, so the
committed tokens follow the target distribution exactly. Deterministic drafts use one-hot proposals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spork_trt.spec.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: tuple[int, ...]  # kept node indices: the root, then the accepted nodes
    accepted: tuple[int, ...]  # accepted draft tokens
    bonus: int  # the target's token after the path

    def renumber(self, keep: list[int]) -> Verdict:
        """The same verdict over the tree a subtree(keep) was cut from."""
        return Verdict(tuple(keep[i] for i in self.path), self.accepted, self.bonus)


def verify_greedy(tree: DraftTree, children: tuple[tuple[int, ...], ...], logits: torch.Tensor) -> Verdict:
    """logits [N, V] of the target at every node."""
    best = logits.argmax(-1).tolist()  # [N]
    path, node = [0], 0
    while True:
        nxt = next((c for c in children[node] if tree.tokens[c] == best[node]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return Verdict(tuple(path), tuple(tree.tokens[i] for i in path[1:]), best[node])


def verify_sampling(tree: DraftTree, children: tuple[tuple[int, ...], ...], probs: torch.Tensor,
                    gen: torch.Generator) -> Verdict:
    """probs [N, V]: the target's processed distribution (sampling.processed_probs) at every node."""
    path, node = [0], 0
    while True:
        p = probs[node].double()
        chosen = None
        for c in children[node]:
            x = tree.tokens[c]
            q = one_hot(x, p.shape[0]) if tree.q is None else tree.q[c].double()
            if q[x] <= 0:
                raise AssertionError(f"node {c}: its token has zero probability under its own proposal")
            if torch.rand((), generator=gen, dtype=torch.float64) * q[x] <= p[x]:  # u <= p/q
                chosen = c
                break
            residual = torch.clamp(p - q, min=0)
            total = residual.sum()
            if total <= 0:  # p == q: rejection impossible in exact arithmetic; keep p
                break
            p = residual / total
        if chosen is None:
            bonus = int(torch.multinomial(p, 1, generator=gen))
            return Verdict(tuple(path), tuple(tree.tokens[i] for i in path[1:]), bonus)
        path.append(chosen)
        node = chosen


def one_hot(x: int, v: int) -> torch.Tensor:
    out = torch.zeros(v, dtype=torch.float64)
    out[x] = 1.0
    return out
