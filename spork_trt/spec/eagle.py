"""The learned draft head as a drafter (`--draft eagle`): EAGLE-2 dynamic trees from the head's own probabilities.

The head (draft_head.py) keeps its own one-layer KV cache. Its row p reads (g_p, x_{p+1}): the target's fused
hidden state at p and the embedding of the next token, and predicts x_{p+2}. The target's hidden states arrive with
its forwards (the engine core hands every forward's rows of the committed path to `observe`), so:

  committed head rows   positions [0, length): run with the target's own features
  feats                 fused target features of positions [length, length + len(feats)) whose rows have not run
  propose(root)         runs those rows as one causal chain (the last one reads the root: its output drafts depth 1),
                        then grows the tree depth by depth: node c's row reads its parent row's output h (not a
                        target feature, exactly as training-time test trains it) and c's token, at position
                        root row + depth(c); the best K children per depth by cumulative probability
  commit(tree, verdict) keeps the chain rows (true features) and drops the tree rows; the path's target features
                        (root, accepted tokens) become the next chain, which the next proposal runs

The head's LM head covers the N most frequent target tokens (d2t maps them back); other tokens get probability 0,
which lossless verification allows (greedy: a draft is only a guess; sampling: q is the head's distribution).

`StoreHeadDrafter` (`--draft store-eagle`) pairs the head with the store drafter (drafters.py): the store's tree alone
where it matches long, else the store's tree with the head's grafted on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from spork_trt.config import SamplingConfig, SpecConfig
from spork_trt.spec.draft_head import DraftHead
from spork_trt.spec.drafters import Drafter, StoreDrafter, level_mask
from spork_trt.engines.kv_cache import KVCache, Rows
from spork_trt.spec.tree import DraftTree, graft
from spork_trt.spec.tree_growth import grow_tree
from spork_trt.spec.verification import Verdict


def lookup(table) -> Callable[[list[int]], torch.Tensor]:
    """Token ids -> float32 embeddings [T, C] from the target's table [V, C]: a torch tensor, or a memory-mapped
    numpy array (a build's head_embeddings.npy: only the rows asked for are read)."""
    if isinstance(table, torch.Tensor):
        return lambda ids: table[ids].float()
    return lambda ids: torch.from_numpy(np.asarray(table[ids], dtype=np.float32))


@dataclass
class EagleDrafter(Drafter):
    head: DraftHead
    embed: Callable[[list[int]], torch.Tensor]  # token ids [T] -> the target's embeddings [T, C] (see `lookup`)
    sampling: SamplingConfig
    gen: torch.Generator
    # the head's step: an onnx_head.OnnxHead over the build's head.onnx, or (None) the head itself in PyTorch
    step: Callable | None = None
    wants_hidden: ClassVar[bool] = True  # the engine core passes the target's hidden states to `observe`
    cache: Rows | None = None  # the head's one-layer KV cache (the step's own kind)
    tokens: list[int] = field(default_factory=list)  # committed tokens before the root
    feats: list[torch.Tensor] = field(default_factory=list)  # [C] each: fused features of rows not run yet
    observed: list[torch.Tensor] = field(default_factory=list)  # [n, k*C] target hidden states since the last use
    rows: dict[int, int] = field(default_factory=dict)  # tree node -> pending head row (relative to cache.length)
    outs: dict[int, torch.Tensor] = field(default_factory=dict)  # tree node -> its row's output h [C]

    def observe(self, hidden: torch.Tensor) -> None:
        """hidden [n, k*C]: the target's hidden states at the next committed positions, in order."""
        self.observed.append(hidden)

    @torch.inference_mode()
    def reset(self, prompt_ids: list[int], max_len: int, rows=None) -> None:
        """Start a sequence whose prompt's target hidden states were observed (one per prompt token)."""
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.step.make_cache(max_len) if self.step else KVCache(self.head.hc.layer_config(), max_len)
        self.cache.truncate(0)
        self.tokens, self.feats, self.rows, self.outs = list(prompt_ids), [], {}, {}
        self.take_observed()
        assert len(self.feats) == len(prompt_ids), (len(self.feats), len(prompt_ids))

    def take_observed(self) -> None:
        if self.observed:
            self.feats += list(self.head.fuse(torch.cat(self.observed).float()))  # [n, C] -> n x [C]
            self.observed = []

    @torch.inference_mode()
    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        base, n = self.cache.length, len(self.feats)
        nxt = (self.tokens + [root])[base + 1:base + n + 1]  # x_{p+1} for the chain's rows p = base .. base + n - 1
        assert n >= 1 and len(nxt) == n, (n, len(nxt), base, len(self.tokens))
        mask = torch.ones(1, n, base + n, dtype=torch.bool)
        mask[0, :, base:] = torch.ones(n, n, dtype=torch.bool).tril()
        h, logits = self.run(nxt, torch.stack(self.feats), torch.arange(base, base + n), mask)  # [n, C], [n, N]
        self.rows, self.outs = {0: n - 1}, {0: h[-1]}
        greedy = self.sampling.greedy  # greedy drafts pick over the draft vocabulary, mapped by d2t
        return grow_tree(root, logits[-1:] if greedy else self.to_target(logits[-1:]), spec, self.sampling, self.gen,
                         self.forward_level, self.head.d2t if greedy else None)

    def forward_level(self, level: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One depth of nodes: each reads its parent row's output and its own token; sees the committed rows, the
        chain and its ancestors' rows. Returns logits [len(level), N] (greedy) or [len(level), V] (sampling)."""
        base = self.cache.length
        mask, depth = level_mask(level, parents, self.rows, base, self.cache.pending)
        g = torch.stack([self.outs[parents[node]] for node in level])  # [L, C]
        pos = torch.tensor([base + self.rows[0] + d for d in depth])  # the root row's position + depth
        h, logits = self.run([tokens[node] for node in level], g, pos, mask)
        for j, node in enumerate(level):
            self.outs[node] = h[j]
        return logits if self.sampling.greedy else self.to_target(logits)

    def run(self, tokens: list[int], g: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward of T rows (tokens [T], g [T, C], pos [T], mask [1, T, S]) appended to its cache as
        pending rows; returns (h [T, C], draft-vocabulary logits [T, N])."""
        emb = self.embed(tokens)[None]  # [1, T, C]
        h, logits = (self.step or self.head)(emb, g[None], pos[None], mask, self.cache)
        self.cache.written(len(tokens))
        return h[0], logits[0]

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[L, N] draft-vocabulary logits -> [L, V] over the target's vocabulary (-inf outside the draft's)."""
        out = torch.full((logits.shape[0], self.head.hc.target_vocab), float("-inf"))
        out[:, self.head.d2t] = logits.float()
        return out

    @torch.inference_mode()
    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        """Keep the chain's rows (the target's features), drop the tree's; the committed path's target features
        (observed for this step's forward) become the next chain."""
        if self.rows:
            self.cache.commit(list(range(self.rows[0] + 1)))
            self.feats = []
        self.tokens += [tree.tokens[i] for i in verdict.path]  # the root and the accepted tokens
        self.take_observed()
        self.rows, self.outs = {}, {}
        assert self.cache.length + len(self.feats) == len(self.tokens), (self.cache.length, len(self.feats))


@dataclass
class StoreHeadDrafter(Drafter):
    """`--draft store-eagle`: the store drafter (the request's own text, then the datastore) and the learned draft
    head together. Where the store's best match is at least `min_match` tokens (likely right, free) its tree alone;
    otherwise the store's tree with the head's nodes grafted on after its own (greedy: the scheduler's allotment picks
    the nodes worth verifying; the head's nodes are tagged as a second source, whose odds the scheduler keeps apart
    from the store's), or the head's tree alone (sampling: a drawn node is lossless only within its own tree). The
    head drafts no deeper than the scheduler's current depth (halved after failed steps: fewer head forwards). It
    reads the target's hidden states of every commit and catches up on a step it did not draft."""

    store: StoreDrafter
    head: EagleDrafter
    head_spec: SpecConfig  # the head's own tree shape
    min_match: int
    wants_hidden: ClassVar[bool] = True

    def observe(self, hidden: torch.Tensor) -> None:
        self.head.observe(hidden)

    def reset(self, prompt_ids: list[int], max_len: int, rows=None) -> None:
        self.store.reset(prompt_ids, max_len)
        self.head.reset(prompt_ids, max_len, rows)

    def propose(self, root: int, spec: SpecConfig) -> DraftTree:
        tree = self.store.propose(root, spec)
        if max(tree.score[1:], default=0.0) * self.store.ngram.max_n >= self.min_match:
            return tree  # a store node's score is its matched suffix length / max_n
        mine = self.head.propose(root, replace(self.head_spec, tree_depth=min(self.head_spec.tree_depth,
                                                                             spec.tree_depth)))
        if not self.head.sampling.greedy:  # the head's own source: its odds stay apart from the store's
            return replace(mine, source=(0,) + (1,) * (len(mine) - 1))
        return graft(tree, mine, self.head_spec.tree_budget + spec.tree_budget)

    def commit(self, tree: DraftTree, verdict: Verdict) -> None:
        self.store.commit(tree, verdict)
        self.head.commit(tree, verdict)
