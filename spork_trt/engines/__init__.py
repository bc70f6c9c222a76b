"""Engines run one model over new tokens against preallocated KV caches.

Interface (the torch engine is the reference; ONNX Runtime and TensorRT engines follow it):
  make_pool(slots, max_len) -> KVPool              one preallocated buffer pair, a cache view per slot
  forward_batch([SeqInput]) -> [logits [n_b, V]]   a ragged batch: each sequence's new tokens after every row its
                                                   cache holds (committed + pending), with its tree's own [n, n]
                                                   ancestor mask; appends n_b pending rows to each cache. One
                                                   forward for all of them (the engine pads to [B, T]).
  reset(max_len)                                   ready for a new sequence of at most max_len positions
  forward(input_ids [B,T], position_ids [B,T], mask [B,T,S]) -> logits [B,T,V]
                                                   S = length + pending + T; appends T pending KV rows
  commit(rows=None)                                keep pending rows (indices from `length`; None: all)
  truncate(length)                                 roll back to `length` committed rows
  fresh()                                          a new engine over the same weights/session, with no cache
                                                   (one per concurrent request: caches are per sequence)
  length, pending                                  committed rows; rows written since the last commit
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..kv_cache import KVPool, Rows


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a ragged batch: new tokens after every row its cache holds."""

    cache: Rows  # the sequence's slot (or own cache): rows [0, length + pending) are its context
    tokens: tuple[int, ...]  # [n]
    positions: tuple[int, ...]  # [n]
    ancestors: torch.Tensor  # [n, n] bool: row i may attend new token j (itself and its ancestors)

    @property
    def context(self) -> int:
        return self.cache.length + self.cache.pending

    def mask(self) -> torch.Tensor:
        """[1, n, context + n]: every context row, then the tree's own ancestors."""
        n = len(self.tokens)
        return torch.cat([torch.ones(n, self.context, dtype=torch.bool), self.ancestors], dim=1)[None]


@dataclass(frozen=True)
class Padded:
    """A ragged batch laid out for one forward: every sequence padded to the most new tokens T, past rows [B, P]
    (P >= every context; a sequence sees only its own). A padding row attends to itself only."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T, P + T] bool
    context: list[int]  # [B] rows each sequence's cache holds

    @classmethod
    def of(cls, seqs: list[SeqInput], past: int | None = None) -> Padded:
        """`past`: P (default: the longest context)."""
        ctx = [s.context for s in seqs]
        for c, s in zip(ctx, seqs):
            if c + len(s.tokens) > s.cache.max_len:
                raise ValueError(f"KV cache full: {c + len(s.tokens)} positions needed, {s.cache.max_len} allocated")
        b, t, p = len(seqs), max(len(s.tokens) for s in seqs), max(ctx) if past is None else past
        ids, pos = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)
        mask = torch.zeros(b, t, p + t, dtype=torch.bool)
        mask[:, torch.arange(t), p + torch.arange(t)] = True
        for i, s in enumerate(seqs):
            n = len(s.tokens)
            ids[i, :n], pos[i, :n] = torch.tensor(s.tokens), torch.tensor(s.positions)
            mask[i, :n, :ctx[i]] = True
            mask[i, :n, p:p + n] = s.ancestors
        return cls(ids, pos, mask, ctx)


def chain_input(cache: Rows, ids: list[int]) -> SeqInput:
    """Tokens as one causal chain after every row `cache` holds."""
    base, n = cache.length + cache.pending, len(ids)
    return SeqInput(cache, tuple(ids), tuple(range(base, base + n)), torch.ones(n, n, dtype=torch.bool).tril())


class CachedEngine(ABC):
    """What every engine shares: KV row bookkeeping, delegated to its cache (a kv_cache.Rows)."""

    cache: Rows | None = None
    # forward_batch pads every sequence to the longest ([B, T]): a batch costs B * T tokens, not their sum
    padded_batches: bool = True

    @abstractmethod
    def make_cache(self, max_len: int) -> Rows:
        """Preallocated buffers for `max_len` positions."""

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    @property
    def pending(self) -> int:
        return 0 if self.cache is None else self.cache.pending

    @abstractmethod
    def make_pool(self, slots: int, max_len: int) -> KVPool:
        """One preallocated buffer pair for `slots` sequences of at most `max_len` positions."""

    def forward_batch(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """Logits [n_b, V] of each sequence's new tokens; appends them as pending rows of its cache. This
        default runs the sequences one by one (engines override it with one padded forward)."""
        out = []
        for s in seqs:
            self.cache = s.cache
            out.append(self.forward(torch.tensor([s.tokens]), torch.tensor([s.positions]), s.mask())[0])
        return out

    @abstractmethod
    def fresh(self) -> "CachedEngine":
        """A new engine sharing this one's weights (or session) with its own, not yet allocated, cache."""

    def reset(self, max_len: int) -> None:
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = self.make_cache(max_len)
        self.cache.truncate(0)

    def commit(self, rows: list[int] | None = None) -> None:
        self.cache.commit(rows)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


def load_engine(d, entry: dict, cfg, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> CachedEngine:
    """The engine for one manifest entry ({"path", "precision", "layers", ...}) of build folder `d`: a TensorRT plan
    (.plan) or an ONNX graph on ONNX Runtime with `providers`."""
    path = d / entry["path"]
    if path.suffix == ".plan":
        from .trt_engine import TrtEngine

        return TrtEngine(path, cfg, n_layers=entry["layers"])
    from .onnx_engine import OnnxEngine

    return OnnxEngine(path, cfg, n_layers=entry["layers"], providers=providers)


def forward_chain(engine, ids: list[int]) -> torch.Tensor:
    """Run tokens as one causal chain after every row the engine holds; returns logits [T, V] (rows stay pending)."""
    return engine.forward_batch([chain_input(engine.cache, ids)])[0]


def prefill(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Run a prompt and commit it; returns the last position's logits [V]."""
    logits = forward_chain(engine, prompt_ids)
    engine.commit()
    return logits[-1]
