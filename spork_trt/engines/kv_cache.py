"""Preallocated KV cache owned by the runtime.

Invariant: rows [0, length) hold the committed sequence; rows [length, length + pending) were written by forwards
since the last commit (a drafter growing a tree writes several batches). A forward appends its T rows after them;
the caller then keeps some pending rows with `commit` (gathering them into place) and drops the rest. Rollback is
`truncate`, a length change. No call reallocates or copies the whole cache.
"""
from __future__ import annotations

import numpy as np
import torch

from spork_trt.config import ModelConfig


class Rows:
    """Committed/pending row bookkeeping over a key and a value buffer (torch or numpy) whose position axis is
    `axis`: the part every engine's cache shares."""

    def __init__(self, k, v, axis: int) -> None:
        self.k, self.v, self.axis = k, v, axis
        self.max_len = k.shape[axis]
        self.length = 0  # committed rows
        self.pending = 0  # rows written past `length` since the last commit
        self.generation = 0  # bumped whenever committed rows may be overwritten (truncate, adopt): copies go stale

    def written(self, t: int) -> None:
        """A forward stored T rows after the pending ones: they are pending now."""
        self.pending += t

    def commit(self, rows: list[int] | None = None) -> None:
        """Keep pending rows (indices relative to `length`, ascending; None keeps all) as the next committed rows."""
        if rows is None:
            self.length += self.pending
        elif rows:
            assert all(0 <= a < b for a, b in zip(rows, rows[1:])) and rows[-1] < self.pending, rows
            if rows != list(range(len(rows))):
                lead = (slice(None),) * self.axis
                src = lead + ([r + self.length for r in rows],)
                dst = lead + (slice(self.length, self.length + len(rows)),)
                self.k[dst] = self.k[src]  # the index gather copies first, so overlapping rows are safe
                self.v[dst] = self.v[src]
            self.length += len(rows)
        self.pending = 0

    def forget(self, pending: int) -> None:
        """Keep the first `pending` pending rows, forget the ones a forward wrote after them (a failed forward's: the
        next forward writes those positions again)."""
        assert 0 <= pending <= self.pending, (pending, self.pending)
        self.pending = pending

    def adopt(self, other: Rows, n: int) -> bool:
        """Copy `other`'s first `n` committed rows of its first layers in as this cache's committed rows (a self-draft
        takes the target's prompt rows instead of running the prompt); False, nothing changed, when the two buffers
        differ in kind, device or layout (`other` may have more layers) or `other` has fewer rows."""
        same = (type(self.k) is type(other.k) and self.axis == other.axis and self.k.dtype == other.k.dtype
                and getattr(self.k, "device", None) == getattr(other.k, "device", None)
                and self.k.shape[1:self.axis] + self.k.shape[self.axis + 1:]
                == other.k.shape[1:other.axis] + other.k.shape[other.axis + 1:])
        if not same or self.k.shape[0] > other.k.shape[0] or n > min(other.length, self.max_len):
            return False
        layers = self.k.shape[0]
        rows = (slice(None),) * (self.axis - 1) + (slice(0, n),)  # after the layer axis
        self.k[(slice(None),) + rows] = other.k[(slice(0, layers),) + rows]
        self.v[(slice(None),) + rows] = other.v[(slice(0, layers),) + rows]
        self.length, self.pending = n, 0
        self.generation += 1
        return True

    def truncate(self, length: int) -> None:
        """Roll back to `length` committed rows."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length, self.pending = length, 0
        self.generation += 1


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on the CPU from numpy's calloc, whose pages the OS maps only when a row is first written or read, so a
    pool sized for every slot's whole context holds only the rows requests reach (torch.zeros writes them all: an
    int4 server with 16 slots of 8k positions held 5.5 GB against the ONNX server's 2.2)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    width = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(shape[:-1] + (shape[-1] * width,), dtype=np.uint8)).view(dtype)


class KVCache(Rows):
    """The torch engine's cache: [L, B, Hkv, Smax, D] buffers, attention reads a view of the first S rows."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1, n_layers: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        layers = cfg.n_layers if n_layers is None else n_layers
        shape = (layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        super().__init__(lazy_zeros(shape, dtype, device), lazy_zeros(shape, dtype, device), axis=3)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over existing [L, 1, Hkv, Smax, D] buffers (one slot of a pool: a view, nothing copied)."""
        cache = cls.__new__(cls)
        Rows.__init__(cache, k, v, axis=3)
        return cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] after the pending rows; return views [B, Hkv, S, D], S = length + pending + T.
        Every layer of one forward writes the same rows; the engine calls `written(T)` after the forward."""
        t = k.shape[2]
        start = self.length + self.pending
        end = start + t
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class KVPool:
    """One preallocated KV buffer pair for `slots` sequences, allocated once and never reallocated (fixed
    addresses). Slot s is a cache of the engine's own kind over a view of the buffers (`caches[s]`), so every
    per-sequence operation (forward, commit, truncate, adopt) works on a slot unchanged. Requests take and give
    back slots; a slot given back is rolled back to length 0, or to the prefix it keeps for reuse (prefix_cache)."""

    def __init__(self, caches: list[Rows]) -> None:
        self.caches = caches  # [slots] views into one buffer pair
        self.free = list(range(len(caches)))[::-1]  # pop() hands out the lowest slot first

    @property
    def slots(self) -> int:
        return len(self.caches)

    @property
    def max_len(self) -> int:
        return self.caches[0].max_len

    @property
    def in_use(self) -> int:
        return self.slots - len(self.free)

    def take(self, slot: int | None = None) -> int | None:
        """A free slot's index (`slot`, or the lowest), or None when every slot is in use."""
        if slot is not None:
            self.free.remove(slot)
            return slot
        return self.free.pop() if self.free else None

    def give_back(self, slot: int, keep: int = 0) -> None:
        """`slot` is free again, its first `keep` committed rows kept (prefix_cache), the rest rolled back."""
        assert slot not in self.free and 0 <= slot < self.slots, slot
        self.caches[slot].truncate(keep)
        self.free.append(slot)
        self.free.sort(reverse=True)
