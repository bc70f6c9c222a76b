"""Preallocated KV cache owned by the runtime.

Invariant: rows [0, length) hold the committed sequence. A forward writes its T new rows at [length, length + T)
without moving `length`; the caller then keeps some of them with `commit` (gathering them into place) or drops
them all by doing nothing. Rollback is `truncate`, a length change. No call reallocates or copies the whole cache.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1, n_layers: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        layers = cfg.n_layers if n_layers is None else n_layers
        shape = (layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)  # [L, B, Hkv, Smax, D]
        self.v = torch.zeros(shape, dtype=dtype)  # [L, B, Hkv, Smax, D]
        self.max_len = max_len
        self.length = 0  # committed rows
        self.pending = 0  # rows written past `length` by the last forward

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] at [length, length + T); return views [B, Hkv, S, D] with S = length + T."""
        t = k.shape[2]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions needed, {self.max_len} allocated")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        self.pending = t
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def commit(self, rows: list[int] | None = None) -> None:
        """Keep pending rows (indices relative to `length`, ascending; None keeps all) as the next committed rows."""
        if rows is None:
            self.length += self.pending
        elif rows:
            assert all(0 <= a < b for a, b in zip(rows, rows[1:])) and rows[-1] < self.pending, rows
            if rows != list(range(len(rows))):
                src = torch.tensor(rows) + self.length
                dst = slice(self.length, self.length + len(rows))
                self.k[:, :, :, dst] = self.k[:, :, :, src]  # index gather copies first, so overlap is safe
                self.v[:, :, :, dst] = self.v[:, :, :, src]
            self.length += len(rows)
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Roll back to `length` committed rows."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length, self.pending = length, 0
