"""The datastore (suffix array over token ids) and the store drafter: matches equal a brute-force scan, forks come
from the matches' continuations (most frequent first), the request's own text comes first, files load memory-mapped,
and a packed corpus builds the same store as its self-data folder."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from spork_trt.config import SpecConfig
from spork_trt.spec.datastore import KEY, SEP, Datastore
from spork_trt.spec.drafters import NgramDrafter, StoreDrafter
from spork_trt.errors import UserError
from spork_trt.export import artifacts

rng = random.Random(3)
SEQS = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(30)]  # small vocab: many repeats


def occurrences(seqs, query):
    """Brute force: (sequence, start) of every occurrence of `query`."""
    n = len(query)
    return [(s, i) for s, seq in enumerate(seqs) for i in range(len(seq) - n + 1) if seq[i:i + n] == list(query)]


@pytest.fixture(scope="module")
def store():
    return Datastore.build(SEQS)


def test_span_counts_every_occurrence_and_nothing_across_sequences(store):
    for n in (1, 2, 3, 5, 9):
        for _ in range(20):
            s = rng.choice([s for s in SEQS if len(s) >= n])
            i = rng.randrange(len(s) - n + 1)
            lo, hi = store.span(s[i:i + n])
            assert hi - lo == len(occurrences(SEQS, s[i:i + n]))
            for j in range(lo, hi):
                p = int(store.sa[j])
                assert store.tokens[p:p + n].tolist() == s[i:i + n]
    lo, hi = store.span([7, 1])  # token 7 never occurs
    assert lo == hi
    assert len(store) == sum(map(len, SEQS)) and (store.tokens == SEP).sum() == len(SEQS)


def test_longest_match_is_the_longest_suffix_that_occurs(store):
    for _ in range(50):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 25))]
        n, (lo, hi) = store.longest(ctx)
        want = max((k for k in range(1, min(KEY, len(ctx)) + 1) if occurrences(SEQS, ctx[len(ctx) - k:])), default=0)
        assert n == want
        if n:
            assert hi - lo == len(occurrences(SEQS, ctx[len(ctx) - n:]))


def test_continuations_follow_the_matches_most_frequent_first():
    seqs = [[1, 2, 3, 4]] * 3 + [[1, 2, 3, 7, 8]] * 2 + [[9, 2, 3, 5]]
    store = Datastore.build(seqs)
    got = store.continuations([0, 2, 3], depth=3, width=3)  # longest match: [2, 3]
    assert [c for c, _ in got] == [[4], [7, 8], [5]]
    assert [round(s, 2) for _, s in got] == [0.5, 0.33, 0.17]
    assert store.continuations([1, 2, 3], depth=1, width=3) == [([4], 0.6), ([7], 0.4)]  # [1, 2, 3] is longer
    assert store.continuations([42], depth=3, width=3) == []  # no match


def test_store_drafter_puts_the_requests_own_text_first_and_fills_with_the_store():
    store = Datastore.build([[10, 11, 12, 13], [10, 11, 20, 21]])
    d = StoreDrafter(NgramDrafter(4), store)
    d.reset([10, 11, 30, 10, 11, 31], 64)
    spec = SpecConfig(tree_width=3, tree_depth=2, tree_budget=8)
    tree = d.propose(11, spec)  # context suffix (10, 11) recurs: its continuations first, then the store's
    paths = [[tree.tokens[i] for i in path(tree, leaf)] for leaf in leaves(tree)]
    assert paths[:2] == [[31, 11], [30, 10]]  # latest match first
    assert paths[2] in ([12, 13], [20, 21])  # one store fork fills the width
    empty = StoreDrafter(NgramDrafter(4), store)
    empty.reset([50, 51], 64)
    assert len(empty.propose(52, spec)) == 1  # nothing matches anywhere: the root alone


def path(tree, node):
    out = []
    while node > 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def leaves(tree):
    parents = set(tree.parents)
    return [i for i in range(1, len(tree)) if i not in parents]


def test_saved_store_loads_memory_mapped_and_refuses_other_files(store, tmp_path):
    store.save(tmp_path)
    back = Datastore.load(tmp_path)
    # plain ndarray views over the mapped files (no np.memmap indexing overhead), still memory-mapped
    assert type(back.tokens) is np.ndarray and isinstance(back.tokens.base, np.memmap)
    assert isinstance(back.sa.base, np.memmap) and np.array_equal(back.sa, store.sa)
    assert back.continuations(SEQS[0][:3], 4, 2) == store.continuations(SEQS[0][:3], 4, 2)
    np.save(tmp_path / "store_sa.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(UserError, match="int32"):
        Datastore.load(tmp_path)
    with pytest.raises(UserError, match="export build"):
        Datastore.load(tmp_path / "nowhere")


def test_a_packed_corpus_builds_the_same_store_as_its_self_data_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "answers.jsonl").write_text("".join(json.dumps({"id": str(i), "ids": s, "n_prompt": 1, "stop": "eos"})
                                                + "\n" for i, s in enumerate(SEQS)))
    (data / "recipe.json").write_text(json.dumps({"target_sha256": "ab" * 32, "settings": {
        "magpie": 1, "stdlib": 2, "max_new_tokens": 3, "seed": 4}}))
    packed = artifacts.pack(data, tmp_path / "packed")
    meta = json.loads((packed / "manifest.json").read_text())
    assert meta["tokens"] == sum(map(len, SEQS)) and "--seed 4" in meta["reproduce"]
    assert artifacts.shipped("ab" * 32, tmp_path) == packed and artifacts.shipped("cd" * 32, tmp_path) is None
    a = artifacts.build_store(packed, tmp_path / "a")
    b = artifacts.build_store(data, tmp_path / "b")
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.sa, b.sa)
    with pytest.raises(UserError, match="--store"):
        artifacts.store_source(str(tmp_path / "nothing"), "ab" * 32)
