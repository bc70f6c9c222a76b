"""KV cache invariants on tiny seeded random models: cached decoding == full recomputation, commit of a path ==
having decoded only that path, truncate-then-redo == never having gone there. Also: no reallocation per step."""
from __future__ import annotations

import torch

from spork_trt.engines.kv_cache import KVCache
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

TOL = 1e-5


def model():
    return random_checkpoint(tiny_config(), seed=3, scale=5.0).model


def full(m, ids):
    n = len(ids)
    with torch.no_grad():
        return m(torch.tensor([ids]), torch.arange(n)[None], causal_mask(0, n)).logits[0]  # [T, V]


def step(m, cache, ids, positions=None, mask=None):
    p, t = cache.length, len(ids)
    pos = torch.arange(p, p + t) if positions is None else torch.tensor(positions)
    mask = causal_mask(p, t) if mask is None else mask
    with torch.no_grad():
        out = m(torch.tensor([ids]), pos[None], mask, cache).logits[0]
    cache.written(t)
    return out


def test_cached_decoding_equals_full_recomputation():
    m = model()
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = KVCache(m.cfg, 64)
    k_ptr = cache.k.data_ptr()
    got = [step(m, cache, ids[:25])]
    cache.commit()
    for t in ids[25:]:
        got.append(step(m, cache, [t]))
        cache.commit()
    assert cache.k.data_ptr() == k_ptr and cache.length == 40  # preallocated buffers, never replaced
    assert (torch.cat(got) - full(m, ids)).abs().max() < TOL


def tree_mask(prefix: int, parents: list[int]) -> torch.Tensor:
    """[1, N, prefix + N]: each node sees the prefix, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(1, n, prefix + n, dtype=torch.bool)
    mask[..., :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[0, i, prefix + j] = True
            j = parents[j]
    return mask


def test_commit_of_a_tree_path_equals_decoding_only_that_path():
    m = model()
    prompt = [5, 17, 3, 88, 40, 41, 7]
    # tree: 0 <- 1 <- 3 ; 0 <- 2 <- 4 <- 5  (node tokens below); keep path 0, 2, 4
    parents = [-1, 0, 0, 1, 2, 4]
    tokens = [11, 12, 13, 14, 15, 16]
    depth = [0, 1, 1, 2, 2, 3]
    cache = KVCache(m.cfg, 64)
    step(m, cache, prompt)
    cache.commit()
    p = cache.length
    tree_logits = step(m, cache, tokens, [p + d for d in depth], tree_mask(p, parents))
    path = [0, 2, 4]
    want = full(m, prompt + [tokens[i] for i in path])[p:]
    assert (tree_logits[path] - want).abs().max() < TOL  # tree attention == decoding the path alone
    cache.commit(path)
    nxt = step(m, cache, [30])
    assert (nxt - full(m, prompt + [11, 13, 15, 30])[-1:]).abs().max() < TOL


def test_truncate_then_redo_equals_never_going_there():
    m = model()
    ids = [4, 8, 15, 16, 23, 42]
    cache = KVCache(m.cfg, 32)
    step(m, cache, ids)
    cache.commit()
    step(m, cache, [1, 2, 3, 4])  # a detour
    cache.commit()
    cache.truncate(len(ids))
    got = step(m, cache, [9, 10])
    assert (got - full(m, ids + [9, 10])[-2:]).abs().max() < TOL


def test_uncommitted_rows_are_discarded():
    m = model()
    cache = KVCache(m.cfg, 32)
    step(m, cache, [1, 2, 3])
    cache.commit()
    step(m, cache, [50, 51, 52])  # verified but nothing kept
    cache.commit([])
    got = step(m, cache, [7])
    assert cache.length == 3 and (got - full(m, [1, 2, 3, 7])[-1:]).abs().max() < TOL


def test_a_tree_grown_in_several_forwards_commits_like_one():
    """Drafters grow trees one depth per forward: pending rows accumulate across forwards before the commit."""
    m = model()
    prompt = [9, 8, 7, 6]
    cache = KVCache(m.cfg, 32)
    step(m, cache, prompt)
    cache.commit()
    p = cache.length
    parents = [-1, 0, 0, 1]
    tokens = [20, 21, 22, 23]
    full_mask = tree_mask(p, parents)
    step(m, cache, tokens[:1], [p], full_mask[:, :1, : p + 1])  # depth 0
    step(m, cache, tokens[1:3], [p + 1, p + 1], full_mask[:, 1:3, : p + 3])  # depth 1
    last = step(m, cache, tokens[3:], [p + 2], full_mask[:, 3:, : p + 4])  # depth 2
    assert cache.pending == 4
    assert (last - full(m, prompt + [20, 21, 23])[-1:]).abs().max() < TOL
    cache.commit([0, 1, 3])
    assert (step(m, cache, [5]) - full(m, prompt + [20, 21, 23, 5])[-1:]).abs().max() < TOL


def test_adopted_prompt_rows_equal_running_the_prompt():
    """An early-exit draft that takes the target's prompt rows decodes exactly as if it had run the prompt itself;
    adopt refuses buffers of another layout or too few rows, and changes nothing then."""
    from spork_trt.engines import forward_chain, prefill
    from spork_trt.engines.torch_engine import TorchEngine

    m = model()
    prompt = [3, 9, 27, 17, 51, 25, 11]
    target, early = TorchEngine(m), TorchEngine(m, exit_layer=1)
    rows, own, adopted = target.make_cache(16), early.make_cache(16), early.make_cache(16)
    prefill(target, rows, prompt)
    prefill(early, own, prompt)
    assert adopted.adopt(rows, len(prompt)) and adopted.length == len(prompt)
    assert torch.equal(forward_chain(early, adopted, [5, 6]), forward_chain(early, own, [5, 6]))
    other = TorchEngine(random_checkpoint(tiny_config(n_kv_heads=1), seed=4).model).make_cache(16)
    fresh = target.make_cache(16)
    assert not fresh.adopt(other, 0)  # another KV layout
    assert not fresh.adopt(rows, len(prompt) + 1) and fresh.length == 0  # more rows than it has
