"""The reference engine: our PyTorch Transformer with a preallocated KV cache."""
from __future__ import annotations

import torch

from spork_trt.config import ModelConfig
from spork_trt.engines.kv_cache import KVCache, KVPool
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.engines import Engine, Padded, SeqInput


class TorchEngine(Engine):
    def __init__(self, model: Transformer, exit_layer: int | None = None, taps: tuple[int, ...] = ()) -> None:
        self.model = model.eval()
        self.exit_layer = exit_layer  # run only the first N layers (early-exit drafting)
        self.taps = taps  # hidden states forward_batch can return (the learned draft head's features)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def make_cache(self, max_len: int) -> KVCache:
        return KVCache(self.cfg, max_len, n_layers=self.exit_layer)

    def make_pool(self, slots: int, max_len: int) -> KVPool:
        pool = KVCache(self.cfg, max_len, batch=slots, n_layers=self.exit_layer)  # [L, slots, Hkv, Smax, D]
        return KVPool([KVCache.over(pool.k[:, s:s + 1], pool.v[:, s:s + 1]) for s in range(slots)])

    @torch.inference_mode()
    def forward(self, c: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None, hidden: list | None = None) -> torch.Tensor:
        """input_ids, position_ids [B, T] over cache `c`; mask [B, T, length + pending + T] -> logits [B, T, V], or
        [1, R, V] at `rows` (flat indices b * T + t)."""
        assert mask.shape[-1] == c.length + c.pending + input_ids.shape[1], (mask.shape, c.length, c.pending)
        at = None if rows is None else torch.tensor(rows, dtype=torch.long)
        out = self.model(input_ids, position_ids, mask, c, exit_layer=self.exit_layer, logit_rows=at,
                         taps=self.taps if hidden is not None else ())
        c.written(input_ids.shape[1])
        if hidden is not None:
            self.check_hidden(hidden)
            hidden.extend(out.hidden)  # [T, k*C] per sequence
        return out.logits if rows is None else out.logits[None]

    @torch.inference_mode()
    def forward_batch(self, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor]:
        """One padded forward over B sequences (see BatchKV); one sequence runs in place (`forward`)."""
        if len(seqs) == 1:
            return super().forward_batch(seqs, hidden)
        self.check_hidden(hidden)
        batch = Padded.of(seqs)
        kv = BatchKV(seqs, batch.context)
        out = self.model(batch.input_ids, batch.position_ids, batch.mask, kv, exit_layer=self.exit_layer,
                         logit_rows=batch.logit_rows, taps=self.taps if hidden is not None else ())
        for i, s in enumerate(seqs):
            s.cache.written(len(s.tokens))
            if hidden is not None:
                hidden.append(out.hidden[i, :len(s.tokens)])  # [n_b, k*C]
        return batch.split(out.logits)  # [R, V] -> [r_b, V] each


class BatchKV:
    """A model.KVStore over several sequences' caches: each layer stores every sequence's new rows in its own cache
    and returns keys/values padded to [B, Hkv, P + T, D] (P the longest context; rows past a sequence's own
    context are zeros, masked off)."""

    def __init__(self, seqs: list[SeqInput], context: list[int]) -> None:
        self.seqs, self.ctx, self.p = seqs, context, max(context)  # context [B]: rows each cache holds

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, T, D] -> keys, values [B, Hkv, P + T, D]."""
        b, hkv, t, d = k.shape
        keys, values = k.new_zeros(b, hkv, self.p + t, d), v.new_zeros(b, hkv, self.p + t, d)
        keys[:, :, self.p:], values[:, :, self.p:] = k, v
        for i, (c, s) in enumerate(zip(self.ctx, self.seqs)):
            n, cache = len(s.tokens), s.cache
            cache.k[layer, 0, :, c:c + n], cache.v[layer, 0, :, c:c + n] = k[i, :, :n], v[i, :, :n]
            keys[i, :, :c], values[i, :, :c] = cache.k[layer, 0, :, :c], cache.v[layer, 0, :, :c]
        return keys, values
