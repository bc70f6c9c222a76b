"""The reference engine: our PyTorch Transformer with a preallocated KV cache."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..kv_cache import KVCache
from ..model import Transformer
from . import CachedEngine


class TorchEngine(CachedEngine):
    def __init__(self, model: Transformer, exit_layer: int | None = None) -> None:
        self.model = model.eval()
        self.exit_layer = exit_layer  # run only the first N layers (early-exit drafting)
        self.cache: KVCache | None = None

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def fresh(self) -> TorchEngine:
        return TorchEngine(self.model, self.exit_layer)

    def make_cache(self, max_len: int) -> KVCache:
        return KVCache(self.cfg, max_len, n_layers=self.exit_layer)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids [B, T]; mask [B, T, length + pending + T] -> logits [B, T, V]."""
        c = self.cache
        assert c is not None, "call reset() first"
        assert mask.shape[-1] == c.length + c.pending + input_ids.shape[1], (mask.shape, c.length, c.pending)
        logits = self.model(input_ids, position_ids, mask, c, exit_layer=self.exit_layer).logits
        c.written(input_ids.shape[1])
        return logits
