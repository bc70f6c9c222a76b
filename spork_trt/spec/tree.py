"""Token trees as data, compiled once per step into the buffers a target forward needs.

A tree is a parent index per node. Node 0 is the root: the last committed token, whose KV is not in the cache
yet; every other node is a draft token. Parents precede children (parents[i] < i), so a path's node indices
ascend. A chain is a tree whose parents are [-1, 0, 1, 2, ...]. Static presets (Medusa/EAGLE-style choice lists)
and trees grown at run time compile through the same function, `compile_tree`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [N] node 0 = root
    parents: tuple[int, ...]  # [N] parents[0] = -1, parents[i] < i
    # [N, V] the proposal distribution each draft node was drawn from (given its earlier siblings were drawn);
    # None: nodes were chosen deterministically (top-K, n-gram), i.e. a one-hot proposal. Row 0 is unused.
    q: torch.Tensor | None = None
    # [N] the drafter's own confidence in each node, in [0, 1] (model drafters: the draft probability of the node
    # given its parent; n-gram: the matched suffix length / the longest it tries); None: none given. Row 0 unused.
    score: tuple[float, ...] | None = None
    # [N] which of a combined drafter's sources proposed each node (0: the first tree; `graft` numbers the nodes it
    # adds after it); the scheduler keeps acceptance odds per source. None: one source. Row 0 unused.
    source: tuple[int, ...] | None = None
    # [N] each node's rank among its siblings in its own drafter's tree (`graft`: a grafted node keeps the rank it had
    # in its tree, its siblings merged into the first tree's nodes counted); None: the drafting order. Row 0 unused.
    rank: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents) and self.parents[0] == -1, self.parents
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), self.parents
        assert all(x is None or len(x) == len(self.tokens) for x in (self.score, self.source, self.rank))

    def __len__(self) -> int:
        return len(self.tokens)

    def ranks(self) -> tuple[int, ...]:
        """[N] each node's rank among its siblings (0: its drafter's first choice); root 0."""
        if self.rank is not None:
            return self.rank
        rank, seen = [0], {}
        for p in self.parents[1:]:
            rank.append(seen.get(p, 0))
            seen[p] = rank[-1] + 1
        return tuple(rank)

    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        return cls((root,), (-1,))

    def subtree(self, keep: list[int]) -> DraftTree:
        """The nodes `keep` (ascending, root first, every kept node's parent kept), renumbered in that order."""
        if len(keep) == len(self.tokens):
            return self  # nothing pruned (every plain step, every unpruned tree): no copy on the per-step path
        new = {old: i for i, old in enumerate(keep)}
        parents = tuple(-1 if i == 0 else new[self.parents[old]] for i, old in enumerate(keep))
        q = None if self.q is None else self.q[list(keep)]
        score = None if self.score is None else tuple(self.score[i] for i in keep)
        source = None if self.source is None else tuple(self.source[i] for i in keep)
        ranks = self.ranks()
        rank = tuple(ranks[i] for i in keep)  # a pruned node's siblings keep their ranks
        return DraftTree(tuple(self.tokens[i] for i in keep), parents, q, score, source, rank)

    def after(self, chain: list[int]) -> DraftTree:
        """This tree below a chain of tokens (committed tokens the target has not run yet, gate mode): the chain
        is nodes 0..B-1 and this tree's root is node B."""
        if not chain:
            return self
        b = len(chain)
        parents = tuple(range(-1, b - 1)) + tuple(b - 1 if p < 0 else p + b for p in self.parents)
        q = None if self.q is None else torch.cat([self.q.new_zeros(b, self.q.shape[1]), self.q])
        score = None if self.score is None else (1.0,) * b + self.score
        source = None if self.source is None else (0,) * b + self.source
        rank = None if self.rank is None else (0,) * b + self.rank
        return DraftTree(tuple(chain) + self.tokens, parents, q, score, source, rank)


def graft(tree: DraftTree, other: DraftTree, budget: int) -> DraftTree:
    """`tree` with the nodes of `other` (the same root) that it lacks added under their parents, in `other`'s order,
    up to `budget` draft nodes in all; each node keeps the score and sibling rank its own tree gave it, and the added
    ones are tagged as a source of their own (numbered after `tree`'s). Deterministic trees only (no proposal
    distributions): a node drawn by sampling is an honest draw only within its own tree."""
    assert tree.tokens[0] == other.tokens[0] and tree.q is None and other.q is None
    tokens, parents = list(tree.tokens), list(tree.parents)
    scores = list(tree.score or (1.0,) * len(tree))
    sources = list(tree.source or (0,) * len(tree))
    ranks, their_ranks = list(tree.ranks()), other.ranks()
    first = max(sources) + 1  # other's source 0 becomes this
    index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}  # (parent, token) -> node
    where = {0: 0}  # other's node -> the merged tree's
    for i in range(1, len(other)):
        parent = where.get(other.parents[i])
        if parent is None:
            continue  # its parent did not fit
        key = (parent, other.tokens[i])
        if key not in index:
            if len(tokens) - 1 >= budget:
                continue
            index[key] = len(tokens)
            tokens.append(other.tokens[i])
            parents.append(parent)
            scores.append(other.score[i] if other.score else 1.0)
            sources.append(first + (other.source[i] if other.source else 0))
            ranks.append(their_ranks[i])
        where[i] = index[key]
    return DraftTree(tuple(tokens), tuple(parents), score=tuple(scores), source=tuple(sources), rank=tuple(ranks))


@dataclass(frozen=True)
class TreeBuffers:
    mask: torch.Tensor  # [1, N, P + N] bool: the prefix, the node's ancestors and itself
    ancestors: torch.Tensor  # [N, N] bool: the node's ancestors and itself (the mask's last N columns)
    position_ids: torch.Tensor  # [1, N] prefix length + depth
    depth: tuple[int, ...]  # [N] root = 0
    children: tuple[tuple[int, ...], ...]  # [N] child node indices, in drafting order


def compile_tree(parents: tuple[int, ...], prefix_len: int) -> TreeBuffers:
    """Pure function: parent indices -> attention mask over [committed prefix | tree], positions, children."""
    n = len(parents)
    ancestors = torch.zeros(n, n, dtype=torch.bool)  # [N, N] row i: i and its ancestors
    depth = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        ancestors[i, i] = True
        if p >= 0:
            ancestors[i] |= ancestors[p]
            depth[i] = depth[p] + 1
            children[p].append(i)
    mask = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), ancestors], dim=1)[None]
    positions = (torch.tensor(depth) + prefix_len)[None]
    return TreeBuffers(mask, ancestors, positions, tuple(depth), tuple(tuple(c) for c in children))


def chain_parents(n_draft: int) -> tuple[int, ...]:
    """Parents of a chain: the root and `n_draft` draft tokens."""
    return tuple(range(-1, n_draft))


def choices_to_parents(choices: list[tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Medusa-style choice list (each entry: child ranks from the root, e.g. (0,), (1,), (0, 0)) -> (parents,
    node paths). Node i + 1 is choices[i] sorted by length then rank, so parents precede children."""
    ordered = sorted(set(choices), key=lambda c: (len(c), c))
    index = {(): 0}
    parents = [-1]
    for c in ordered:
        if c[:-1] not in index:
            raise ValueError(f"tree choice {c} has no parent {c[:-1]} in the list")
        index[c] = len(parents)
        parents.append(index[c[:-1]])
    return tuple(parents), tuple(ordered)


# Static presets: width/depth shapes in the style of Medusa and EAGLE choice lists.
PRESETS: dict[str, list[tuple[int, ...]]] = {
    "chain4": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "binary3": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)],
    "medusa-small": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)],
}


def covered(continuations, cont) -> bool:
    """Whether `cont` is a prefix of (or equal to) one of `continuations`: it would add no node to their trie."""
    cont = list(cont)
    return any(list(c[:len(cont)]) == cont for c in continuations)
