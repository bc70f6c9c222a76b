"""Engines run one model over new tokens against their own preallocated KV cache.

Interface (the torch engine is the reference; ONNX Runtime and TensorRT engines follow it):
  reset(max_len)                                   ready for a new sequence of at most max_len positions
  forward(input_ids [B,T], position_ids [B,T], mask [B,T,S]) -> logits [B,T,V]
                                                   S = length + pending + T; appends T pending KV rows
  commit(rows=None)                                keep pending rows (indices from `length`; None: all)
  truncate(length)                                 roll back to `length` committed rows
  fresh()                                          a new engine over the same weights/session, with no cache
                                                   (one per concurrent request: caches are per sequence)
  length, pending                                  committed rows; rows written since the last commit
"""

from abc import ABC, abstractmethod

import torch

from ..kv_cache import Rows
from ..model import causal_mask


class CachedEngine(ABC):
    """What every engine shares: KV row bookkeeping, delegated to its cache (a kv_cache.Rows)."""

    cache: Rows | None = None

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
    base, n = engine.length + engine.pending, len(ids)
    return engine.forward(torch.tensor([ids]), torch.arange(base, base + n)[None], causal_mask(base, n))[0]


def prefill(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Run a prompt and commit it; returns the last position's logits [V]."""
    logits = forward_chain(engine, prompt_ids)
    engine.commit()
    return logits[-1]
