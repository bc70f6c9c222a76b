"""The reference model on a torch device (`--device cuda`; CPU runs the same code for tests) over one KV pool, with
static shapes per (batch, tokens) bucket, replayed as CUDA graphs on a GPU.

Layout: the pool is one K and one V tensor [L, slots, Hkv, Smax + 1, D] on the device, allocated once; slot s is a
KVCache view of its first Smax positions (the last one is scratch, where padding rows write and read). A forward
runs slots 0 .. B-1 together (B = the highest slot in it + 1, rounded up to a bucket; slots not in it are padding
rows) with every sequence's T new tokens padded to a bucket:

  write positions [B, T]      each new token's row (its context length + index; padding rows: scratch)
  mask [B, T, Smax + 1]       over absolute positions: the context, then the tree's ancestors (padding: scratch)
  the model writes its new K/V rows in place (scatter into the pool) and attends over the whole slot, masked

So every tensor of a bucket has a fixed shape and address: the forward is captured once per bucket as a CUDA graph
and replayed (inputs copied into its static buffers). Logits come back at the asked-for rows only, gathered and left
on the device: greedy verification takes their argmax there and only the R token ids cross to the host (a 64-node
tree's fp32 logits are 12.6 MB; sampling copies its processed distribution over). Committing a tree path is
kv_cache.Rows.commit on the slot's view (a gather on the device). Written against PyTorch's documented CUDA graph
API (torch.cuda.graph); without a GPU it runs eagerly.
"""
from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from spork_trt.config import DEVICE_DTYPE, DEVICE_DTYPES, ModelConfig
from spork_trt.errors import UserError
from spork_trt.engines.kv_cache import KVCache, KVPool
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.engines import Engine, SeqInput

T_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # new tokens per sequence, padded up to one of these
# with CUDA graphs, a forward may pad up to this many buckets past its own when a larger one replays faster: on an
# H200, cuBLAS's fp32 kernels for 8-16 rows took 7.1-7.5 ms a forward and those for 32 rows 4.7 (docs/engines.md)
LOOKAHEAD = 2
LOOKAHEAD_ROWS = 256  # ... among buckets of at most this many rows (B x T): each captured graph keeps its own memory
# a pool whose slot views are all gone is kept for the next make_pool of its slots and rounded length, captured graphs
# included (run_alone makes a pool per request: on an H200, recapturing its buckets cost about as much as decoding)
POOL_ROUND = 512  # positions per slot are allocated in multiples of this, so requests of similar length share a pool
SPARE_POOLS = 2  # pools kept for reuse (the oldest goes first)
DTYPES = dict(zip(DEVICE_DTYPES, (torch.bfloat16, torch.float16, torch.float32)))
log = logging.getLogger(__name__)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if s >= n), n)


def require_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this torch build sees no CUDA device (torch.cuda.is_available() is False); "
                        "run on a GPU host with a CUDA build of torch, or use the cpu engines")
    return dev


@dataclass
class Pool:
    """One KV pool on the device: full tensors (scratch position included) and its buckets' buffers and graphs."""

    k: torch.Tensor  # [L, slots, Hkv, Smax + 1, D]
    v: torch.Tensor
    buckets: dict = field(default_factory=dict)  # (B, T) -> Bucket: static buffers (and graphs) over this pool

    @property
    def scratch(self) -> int:
        return self.k.shape[3] - 1

    @property
    def shape(self) -> tuple[int, int]:
        """(slots, positions per slot): what a spare pool is found by."""
        return self.k.shape[1], self.scratch


class SparePools:
    """Pools whose slot views are all gone, found by their shape (slots, positions), newest last, at most SPARE_POOLS (a view's
    finalizer may run on any thread: a lock guards the list)."""

    def __init__(self) -> None:
        self.pools: list[Pool] = []
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> Pool | None:
        with self.lock:
            for i, pool in enumerate(self.pools):
                if pool.shape == shape:
                    return self.pools.pop(i)
        return None

    def give(self, pool: Pool) -> None:
        with self.lock:
            self.pools.append(pool)
            del self.pools[:-SPARE_POOLS]


@dataclass
class Views:
    """How many slot views of a pool are alive; when none is, the pool is spare."""

    alive: int
    spare: SparePools
    pool: Pool

    def gone(self) -> None:
        with self.spare.lock:
            self.alive -= 1
            last = self.alive == 0
        if last:
            self.spare.give(self.pool)


class PoolKV:
    """model.KVStore over the first B slots of a pool: a layer's new rows are scattered in place at `write`
    positions and the layer attends over the slots' whole buffers (the mask says which rows)."""

    def __init__(self, pool: Pool, b: int, write: torch.Tensor) -> None:
        self.pool, self.b, self.write = pool, b, write  # write [B, T] positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, T, D] -> keys, values [B, Hkv, Smax + 1, D] (views of the pool)."""
        keys, values = self.pool.k[layer, :self.b], self.pool.v[layer, :self.b]
        idx = self.write[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, idx, k.to(keys.dtype))
        values.scatter_(2, idx, v.to(values.dtype))
        return keys, values


@dataclass
class Bucket:
    """A (B, T) shape's static buffers (and its CUDA graph)."""

    ids: torch.Tensor  # [B, T]
    pos: torch.Tensor  # [B, T]
    write: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T, Smax + 1]
    logits: torch.Tensor | None = None  # [B * T, V] outputs of the captured forward
    hidden: torch.Tensor | None = None  # [B, T, k*C]
    graph: object | None = None
    ms: float | None = None  # its graph's replay, timed once after capture (None: not timed)


class DeviceEngine(Engine):
    name = "the device engine"
    features: frozenset[str] = frozenset()  # what it runs beyond Llama's decoder (config.Architecture.features)

    def __init__(self, model: Transformer, device: str = "cuda", dtype: str = DEVICE_DTYPE, taps: tuple[int, ...] = (),
                 graphs: bool | None = None, lookahead: int = LOOKAHEAD) -> None:
        model.cfg.arch.require(self.features, self.name, "run it on the PyTorch reference engine (`python -m "
                               "spork_trt generate --model PATH --dtype fp32`)")
        self.device = require_device(device)
        if dtype not in DTYPES:
            raise UserError(f"--dtype {dtype}: use {', '.join(DTYPES)}")
        self.dtype = dtype
        if dtype != "fp32" and self.device.type == "cuda":  # measured on an H200: docs/engines.md
            log.warning("--dtype %s on a GPU is not lossless: its kernels differ by row count, so trees and batches "
                        "can change the tokens (fp32 is)", dtype)
        self.model = copy.deepcopy(model).eval().to(self.device, DTYPES[dtype])  # the weights on the device, once
        self.model.inv_freq = model.inv_freq.to(self.device)  # RoPE frequencies stay fp32
        self.model.local_inv_freq = model.local_inv_freq.to(self.device)
        self.taps = taps
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.lookahead = lookahead if self.graphs else 0  # eagerly, each forward's own bucket
        self.spare = SparePools()

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def make_pool(self, slots: int, max_len: int) -> KVPool:
        """Slot views of max_len positions over a pool of `slots` (a spare one of the same shape when there is one:
        its graphs are already captured; its rows hold an earlier request's K/V, which no mask reaches)."""
        shape = (slots, -(-max_len // POOL_ROUND) * POOL_ROUND)
        pool = self.spare.take(shape)
        if pool is None:
            full = KVCache(self.cfg, shape[1] + 1, batch=slots, dtype=DTYPES[self.dtype], device=self.device)
            pool = Pool(full.k, full.v)
        caches = [KVCache.over(pool.k[:, s:s + 1, :, :max_len], pool.v[:, s:s + 1, :, :max_len])
                  for s in range(slots)]
        views = Views(len(caches), self.spare, pool)
        for s, c in enumerate(caches):
            c.device_slot = (pool, s)
            weakref.finalize(c, views.gone)  # the last view gone: the pool is spare
        return KVPool(caches)

    def make_cache(self, max_len: int) -> KVCache:
        return self.make_pool(1, max_len).caches[0]

    def forward_batch(self, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor]:
        """One bucketed forward over the sequences' slots (see the module doc)."""
        self.check_hidden(hidden)
        entries = []
        for s in seqs:
            ctx, n = s.context, len(s.tokens)
            if ctx + n > s.cache.max_len:
                raise ValueError(f"KV cache full: {ctx + n} positions needed, {s.cache.max_len} allocated")
            entries.append((s.cache, s.tokens, s.positions, s.mask()[0], s.rows))  # mask [n, context + n]
        return self.run(entries, hidden)

    def forward(self, c: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None, hidden: list | None = None) -> torch.Tensor:
        """input_ids, position_ids [1, T] over cache `c` (a slot of a pool this engine made); mask [1, T, length +
        pending + T] over its rows -> logits [1, R, V] at `rows` (None: all T)."""
        self.check_hidden(hidden)
        t = input_ids.shape[1]
        if mask.shape[-1] > c.max_len:
            raise ValueError(f"KV cache full: {mask.shape[-1]} positions needed, {c.max_len} allocated")
        want = list(range(t)) if rows is None else list(rows)
        entry = (c, tuple(input_ids[0].tolist()), tuple(position_ids[0].tolist()), mask[0], want)
        return self.run([entry], hidden)[0][None]

    @staticmethod
    def slots_of(entries: list[tuple]) -> tuple[Pool, list[int]]:
        """The pool the entries' caches are slots of, and their slot indices."""
        found = [getattr(e[0], "device_slot", None) for e in entries]
        if any(f is None for f in found) or len({id(f[0]) for f in found}) != 1:
            raise ValueError("every sequence of a forward must be a slot of one pool this engine made")
        return found[0][0], [f[1] for f in found]

    def run(self, entries: list[tuple], hidden: list | None) -> list[torch.Tensor]:
        """entries: (cache, tokens [n], positions [n], mask [n, context + n] over the cache's rows, logit rows)."""
        pool, slots = self.slots_of(entries)
        b = bucket(max(slots) + 1, tuple(range(1, pool.k.shape[1] + 1)))
        t = self.pick(pool, b, max(len(e[1]) for e in entries))
        buf = self.bucket(pool, b, t)
        ids = torch.zeros(b, t, dtype=torch.long)
        pos = torch.zeros(b, t, dtype=torch.long)
        write = torch.full((b, t), pool.scratch, dtype=torch.long)
        mask = torch.zeros(b, t, pool.scratch + 1, dtype=torch.bool)
        mask[:, :, pool.scratch] = True  # padding rows see the scratch row only (no empty softmax)
        flat = []
        for (cache, tokens, positions, m, rows), s in zip(entries, slots):
            n, base = len(tokens), cache.length + cache.pending
            ids[s, :n], pos[s, :n] = torch.tensor(tokens), torch.tensor(positions)
            write[s, :n] = torch.arange(base, base + n)
            mask[s, :n] = False
            mask[s, :n, :m.shape[1]] = m
            flat.append(torch.tensor([s * t + r for r in rows], dtype=torch.long))
        for name, x in (("ids", ids), ("pos", pos), ("write", write), ("mask", mask)):
            getattr(buf, name).copy_(x, non_blocking=True)
        self.replay(pool, buf, b, hidden is not None)
        at = torch.cat(flat).to(self.device)
        logits = buf.logits.index_select(0, at).float()  # [R, V], on the device
        self.sync()  # a step's time is its forward's: the scheduler prices trees by it
        out = list(torch.split(logits, [len(f) for f in flat]))
        for (cache, tokens, *_), s in zip(entries, slots):
            cache.written(len(tokens))
            if hidden is not None:
                hidden.append(buf.hidden[s, :len(tokens)].float().cpu())  # [n, k*C]
        return out

    def pick(self, pool: Pool, b: int, n: int) -> int:
        """The tokens bucket for a forward of B slots and up to n tokens each: the fastest of its own bucket and the
        `lookahead` next ones of at most LOOKAHEAD_ROWS rows, each captured and timed the first time it is a
        candidate (the padding rows cost nothing but their arithmetic; a row's result does not depend on them, as
        the tests check)."""
        sizes = [s for s in T_BUCKETS if s >= n][:self.lookahead + 1] or [n]
        sizes = sizes[:1] + [t for t in sizes[1:] if b * t <= LOOKAHEAD_ROWS]
        if len(sizes) == 1:
            return sizes[0]
        for t in sizes:
            self.timed(pool, b, t)
        return min(sizes, key=lambda t: (self.bucket(pool, b, t).ms, t))

    def timed(self, pool: Pool, b: int, t: int) -> None:
        """Time bucket (B, T)'s forward once (capturing its graph if it has none): its static inputs are set to
        padding first, so these runs write K/V only at the scratch position (the next real forward copies its own
        inputs in)."""
        buf = self.bucket(pool, b, t)
        if buf.ms is not None:
            return
        buf.ids.zero_(), buf.pos.zero_(), buf.write.fill_(pool.scratch), buf.mask.fill_(False)
        buf.mask[:, :, pool.scratch] = True
        self.replay(pool, buf, b, False)  # the capture, on first use
        self.sync()
        start = time.perf_counter()
        for _ in range(3):
            self.replay(pool, buf, b, False)
        self.sync()
        buf.ms = 1e3 * (time.perf_counter() - start) / 3

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def bucket(self, pool: Pool, b: int, t: int) -> Bucket:
        if (b, t) not in pool.buckets:
            dev, smax = self.device, pool.scratch + 1
            pool.buckets[(b, t)] = Bucket(
                torch.zeros(b, t, dtype=torch.long, device=dev), torch.zeros(b, t, dtype=torch.long, device=dev),
                torch.full((b, t), pool.scratch, dtype=torch.long, device=dev),
                torch.ones(b, t, smax, dtype=torch.bool, device=dev))
        return pool.buckets[(b, t)]

    @torch.inference_mode()
    def forward_static(self, pool: Pool, buf: Bucket, b: int, taps: tuple[int, ...]) -> None:
        out = self.model(buf.ids, buf.pos, buf.mask, PoolKV(pool, b, buf.write), taps=taps)
        buf.logits = out.logits.reshape(-1, out.logits.shape[-1])  # [B * T, V]
        buf.hidden = out.hidden

    def replay(self, pool: Pool, buf: Bucket, b: int, want_hidden: bool) -> None:
        """Run the bucket's forward: eagerly, or as its CUDA graph (captured on first use, after a warm-up run on a
        side stream as torch.cuda.graph's documentation asks; the taps are always computed when the engine has
        them, so one graph serves both)."""
        taps = self.taps
        if not self.graphs:
            self.forward_static(pool, buf, b, taps if want_hidden else ())
            return
        if buf.graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward_static(pool, buf, b, taps)  # warm-up (its rows are written again below)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.forward_static(pool, buf, b, taps)
            buf.graph = graph
        buf.graph.replay()
