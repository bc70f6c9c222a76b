"""The past K/V rows of a batched ONNX Runtime forward, kept between forwards in the graph's layout.

The graph takes each layer's past as one dense tensor over the batch ([B, P, Hkv, D], or BNSH [B, Hkv, P, D] for the
GQA graph, which then appends the new rows to it in place), while each sequence's rows live in its own pool slot.
Copying every sequence's whole context into that layout each step would move the whole batch's KV cache per step; a
Staging instead mirrors it: buffer [K|V, L, Bcap, Pcap, Hkv, D] (BNSH: [K|V, L, Bcap, Hkv, Pcap, D]), batch row b
mirroring the committed rows of the cache at batch index b (a cache of the same layout). A sequence found at the same
index as in the previous forward gets only the rows committed since copied (a step's accepted path); a new one, or
one whose cache was rolled back (`Rows.generation`), is copied whole. Pcap, a multiple of ROW_BLOCK, grows with the
longest context, so the attention reads at most ROW_BLOCK - 1 masked rows more than it needs; a larger Pcap or Bcap
lays everything out anew (once per ROW_BLOCK tokens of growth). Rows past a sequence's context hold finite stale
values, masked off.
"""
from __future__ import annotations

import numpy as np

from spork_trt.engines.kv_cache import Rows

ROW_BLOCK = 16


class Staging:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, bnsh: bool = False) -> None:
        self.n_layers, self.kv_heads, self.head_dim, self.bnsh = n_layers, kv_heads, head_dim, bnsh
        self.buf = np.zeros(self._shape(0, 0), np.float32)  # [K|V, L, Bcap, Pcap, Hkv, D] (BNSH: Hkv, Pcap)
        self.rows: list[tuple[Rows, int] | None] = []  # [Bcap] (cache, its generation) mirrored at each index
        self.mirrored: list[int] = []  # [Bcap] committed rows copied

    def _shape(self, bcap: int, pcap: int) -> tuple[int, ...]:
        inner = (self.kv_heads, pcap) if self.bnsh else (pcap, self.kv_heads)
        return (2, self.n_layers, bcap, *inner, self.head_dim)

    @property
    def pcap(self) -> int:
        return self.buf.shape[4 if self.bnsh else 3]

    def rows_of(self, i: int, start: int, end: int) -> tuple:
        """Index of batch row i's positions [start, end) in buf[K|V] ([L, ...] for every layer)."""
        span = slice(start, end)
        return (slice(None), i, slice(None), span) if self.bnsh else (slice(None), i, span)

    def overlap(self, caches: list[Rows]) -> int:
        """How many of `caches` sit at the index they had last time (the cheaper staging to reuse)."""
        return sum(i < len(self.rows) and self.rows[i] is not None and self.rows[i][0] is c
                   for i, c in enumerate(caches))

    def past(self, caches: list[Rows], need: int = 0) -> np.ndarray:
        """The buffer [K|V, L, Bcap, Pcap, Hkv, D] (BNSH: [K|V, L, Bcap, Hkv, Pcap, D]) with rows [0, context) of
        caches[b] at batch index b; Pcap >= every context and >= `need`."""
        b, need = len(caches), max(need, *(c.length + c.pending for c in caches))
        if b > self.buf.shape[2] or need > self.pcap:
            bcap = max(b, self.buf.shape[2])
            if self.bnsh:  # GQA reads each sequence's own rows only, whatever Pcap is: lay out once for the longest
                # cache and twice the batch (np.zeros pages cost memory only once written)
                need, bcap = max(need, *(c.max_len for c in caches)), max(b, 2 * self.buf.shape[2])
            pcap = max(self.pcap, -(-need // ROW_BLOCK) * ROW_BLOCK)
            self.buf = np.zeros(self._shape(bcap, pcap), np.float32)  # fresh zeros: only finite values ever, so
            # masking never makes NaN
            self.rows, self.mirrored = [None] * self.buf.shape[2], [0] * self.buf.shape[2]
        for i, c in enumerate(caches):
            if self.rows[i] is None or self.rows[i][0] is not c or self.rows[i][1] != c.generation:
                self.rows[i], self.mirrored[i] = (c, c.generation), 0
            m, ctx = self.mirrored[i], c.length + c.pending
            if ctx > m:
                src = (slice(0, self.n_layers), 0) + self.rows_of(i, m, ctx)[2:]  # the cache's own layout
                self.buf[0][self.rows_of(i, m, ctx)] = c.k[src]
                self.buf[1][self.rows_of(i, m, ctx)] = c.v[src]
            self.mirrored[i] = c.length  # pending rows may still change: copied again next time
        return self.buf
