"""A datastore of the target's own text for drafting (REST-style retrieval): the continuations of the longest match
of a request's recent tokens, most frequent first.

Layout (two .npy files, memory-mapped, never pickled):
  store_tokens.npy  [N] int32: the corpus' token sequences, each followed by SEP
  store_sa.npy      [M] int32: the positions of every token, sorted by the KEY tokens that start there (a suffix
                    array cut at KEY tokens; SEP sorts before every token id)
The positions whose first n tokens equal a query are one contiguous range of store_sa: two binary searches.
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.errors import UserError
from spork_trt.spec.tree import covered

TOKENS, SUFFIXES = "store_tokens.npy", "store_sa.npy"
SEP = -1  # sequence separator; never a token id
KEY = 16  # longest match looked up (tokens)
READS = 64  # most matches whose continuations are counted (evenly spread over the match range)


@dataclass(frozen=True)
class Datastore:
    tokens: np.ndarray  # [N] int32, SEP after each sequence
    sa: np.ndarray  # [M] int32 positions, sorted by tokens[p:p + KEY]

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]]) -> Datastore:
        return cls.index(join(sequences))

    @classmethod
    def index(cls, tokens: np.ndarray) -> Datastore:
        """The store over `tokens` [N] int32 (sequences each followed by SEP)."""
        starts = np.flatnonzero(tokens != SEP).astype(np.int32)  # [M]
        padded = np.concatenate([tokens, np.full(KEY, SEP, dtype=np.int32)])
        keys = [padded[starts + k] for k in range(KEY)]  # KEY x [M]
        order = np.lexsort(keys[::-1])  # last key is the primary one for lexsort
        return cls(tokens, starts[order])

    def save(self, d: Path) -> list[Path]:
        d.mkdir(parents=True, exist_ok=True)
        for name, a in ((TOKENS, self.tokens), (SUFFIXES, self.sa)):
            with atomic.open(d / name, "wb") as fh:
                np.save(fh, a)
        return [d / TOKENS, d / SUFFIXES]

    @classmethod
    def load(cls, d: Path) -> Datastore:
        try:
            tokens = np.load(d / TOKENS, mmap_mode="r", allow_pickle=False)
            sa = np.load(d / SUFFIXES, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UserError(f"no readable datastore in {d} ({e}): build one with `python -m export build`") from None
        if tokens.dtype != np.int32 or sa.dtype != np.int32 or tokens.ndim != 1 or sa.ndim != 1:
            raise UserError(f"{d}: the datastore files must be 1-D int32 arrays")
        # plain ndarray views of the mapped files: still memory-mapped, without np.memmap's per-index overhead (a
        # lookup indexes them ~150 times: 0.49 -> 0.20 ms per proposal on the default store)
        return cls(tokens.view(np.ndarray), sa.view(np.ndarray))

    def __len__(self) -> int:
        return len(self.sa)

    def span(self, query: Sequence[int]) -> tuple[int, int]:
        """[lo, hi) of `sa` whose positions start with `query` (len(query) <= KEY)."""
        q, n = list(query), len(query)

        def key(i: int) -> list[int]:
            p = int(self.sa[i])
            return self.tokens[p:p + n].tolist()

        lo = bisect.bisect_left(range(len(self.sa)), q, key=key)
        hi = bisect.bisect_right(range(lo, len(self.sa)), q, key=key) + lo
        return lo, hi

    def longest(self, context: Sequence[int], min_n: int = 1) -> tuple[int, tuple[int, int]]:
        """The longest suffix of `context` (at most KEY tokens, at least `min_n`) found in the store: (its length,
        its span); (0, (0, 0)) when none. A suffix found means every shorter one is found: binary search on n."""
        best, span = 0, (0, 0)
        lo, hi = min_n, min(KEY, len(context))
        while lo <= hi:
            n = (lo + hi) // 2
            s = self.span(context[len(context) - n:])
            if s[1] > s[0]:
                best, span, lo = n, s, n + 1
            else:
                hi = n - 1
        return best, span

    def continuations(self, context: Sequence[int], depth: int, width: int, min_n: int = 1
                      ) -> list[tuple[list[int], float]]:
        """Up to `width` distinct continuations (at most `depth` tokens) of the longest match of `context`'s suffix,
        most frequent first, each with its share of the matches read."""
        return self.continuations_of(self.longest(context, min_n), depth, width)

    def continuations_of(self, match: tuple[int, tuple[int, int]], depth: int, width: int
                         ) -> list[tuple[list[int], float]]:
        """`continuations` for a match `longest` found: (its length n, its suffix-array span)."""
        n, (lo, hi) = match
        if n == 0 or depth <= 0:
            return []
        picks = np.unique(np.linspace(lo, hi - 1, min(READS, hi - lo)).astype(np.int64))
        conts = []
        for i in picks:
            p = int(self.sa[i]) + n
            cont = self.tokens[p:p + depth].tolist()
            if SEP in cont:
                cont = cont[:cont.index(SEP)]
            if cont:
                conts.append(tuple(cont))
        prefix = Counter(c[:k] for c in conts for k in range(1, len(c) + 1))  # matches through each prefix
        # by the matches through each prefix, the most frequent first; a longer continuation before its own prefix
        ranked = sorted(set(conts), key=lambda c: ([-prefix[c[:k]] for k in range(1, len(c) + 1)] + [1], c))
        out: list[tuple[list[int], float]] = []  # the most frequent path first, then the next most frequent forks
        for cont in ranked:
            if covered([o for o, _ in out], cont):
                continue
            out.append((list(cont), prefix[cont[:1]] / len(picks)))
            if len(out) == width:
                break
        return out


def join(sequences: Iterable[Sequence[int]]) -> np.ndarray:
    """Token sequences -> [N] int32, each followed by SEP."""
    parts = [np.asarray([*s, SEP], dtype=np.int32) for s in sequences]
    if not parts:
        raise UserError("the datastore needs at least one token sequence")
    return np.concatenate(parts)
