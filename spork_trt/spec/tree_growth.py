"""A model drafter's dynamic token tree: per depth, the top-K children of every node of the previous depth, keeping
the K with the highest cumulative draft probability (within the node budget); greedy takes the top children,
sampling draws them without replacement (so every kept child is an honest draw from its recorded proposal q).
`grow_steps` is the growth as a generator of the forwards it needs (the engine core batches them across requests);
`grow_tree` drives it with one forward function."""
from __future__ import annotations

import math
from collections.abc import Generator

import torch

from spork_trt.config import SamplingConfig, SpecConfig
from spork_trt.spec.sampling import processed_probs
from spork_trt.spec.tree import DraftTree


def grow_tree(root: int, logits: torch.Tensor, spec: SpecConfig, sampling: SamplingConfig, gen: torch.Generator,
              forward_level, ids: torch.Tensor | None = None) -> DraftTree:
    """`grow_steps` with forward_level(level, tokens, parents) -> [len(level), V] running each depth."""
    growing = grow_steps(root, logits, spec, sampling, gen, ids)
    try:
        ask = next(growing)
        while True:
            ask = growing.send(forward_level(*ask))
    except StopIteration as done:
        return done.value


def grow_steps(root: int, logits: torch.Tensor, spec: SpecConfig, sampling: SamplingConfig, gen: torch.Generator,
               ids: torch.Tensor | None = None) -> Generator[tuple, torch.Tensor, DraftTree]:
    """A model drafter's dynamic tree: per depth, the top-K children of every node of the previous depth, keeping
    the K with the highest cumulative draft probability (within the node budget). `logits` [1, V]: the draft's
    distribution after the root; yields (level, tokens, parents) for each depth to run and is sent its logits
    [len(level), V]; returns the tree. Greedy drafts may come over a smaller vocabulary: `ids` [N] maps its indices
    to token ids (logits [*, N])."""
    tokens, parents, logp, q_rows, score = [root], [-1], [0.0], [None], [1.0]
    level = [0]
    for depth in range(1, spec.tree_depth + 1):
        room = spec.tree_budget - (len(tokens) - 1)
        if room <= 0:
            break
        if sampling.greedy:
            chosen = top_children(level, logits, logp, spec.tree_width, min(spec.tree_width, room), ids)
        else:
            chosen = sampled_children(level, logits, logp, spec.tree_width, min(spec.tree_width, room), sampling, gen)
        level = []
        for cum, parent, tok, q in chosen:
            level.append(len(tokens))
            tokens.append(tok)
            parents.append(parent)
            score.append(math.exp(min(0.0, cum - logp[parent])))
            logp.append(cum)
            q_rows.append(q)
        if not level or depth == spec.tree_depth or len(tokens) - 1 >= spec.tree_budget:
            break
        logits = yield level, tokens, parents  # [len(level), V]
    q = None
    if not sampling.greedy and len(tokens) > 1:
        q = torch.stack([torch.zeros_like(q_rows[1]) if r is None else r for r in q_rows])  # [N, V]
    return DraftTree(tuple(tokens), tuple(parents), q, tuple(score))


def top_children(level, logits, logp, k: int, slots: int, ids: torch.Tensor | None = None) -> list[tuple]:
    """Greedy: the top-K children of every level node, keeping the `slots` best by cumulative log prob.
    Returns (cumulative log prob, parent, token, None) in rank order. `ids` [N]: token ids of the logits' columns."""
    lp = torch.log_softmax(logits.float(), -1)  # [L, V]
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    tokens = top.indices if ids is None else ids[top.indices]
    cands = [(logp[node] + v, node, t, None) for j, node in enumerate(level)
             for v, t in zip(top.values[j].tolist(), tokens[j].tolist())]
    return sorted(cands, key=lambda c: -c[0])[:slots]


def sampled_children(level, logits, logp, k: int, slots: int, sampling: SamplingConfig,
                     gen: torch.Generator) -> list[tuple]:
    """Sampling: children drawn without replacement from the draft distribution, slots handed to parents
    round-robin in rank order. Which parent gets a slot never depends on a child's drawn value, so every
    child kept is an honest draw from its recorded proposal q_i (what lossless rejection sampling needs)."""
    probs = processed_probs(logits, sampling)  # [L, V] the draft's distribution
    ranked = sorted(range(len(level)), key=lambda j: -logp[level[j]])
    order = [j for _ in range(k) for j in ranked][:slots]
    left = {j: probs[j].clone() for j in ranked}
    out = []
    for j in order:
        q = left[j]
        if q.sum() <= 0:
            continue
        q = q / q.sum()
        t = int(torch.multinomial(q, 1, generator=gen))
        out.append((logp[level[j]] + math.log(float(q[t])), level[j], t, q.clone()))
        q[t] = 0.0
        left[j] = q
    return out
