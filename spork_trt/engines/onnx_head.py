"""The learned draft head's step on ONNX Runtime (`export build` writes head.onnx): a drop-in for
draft_head.DraftHead's forward in the eagle drafter, over a numpy KV cache [1, 1, Smax, Hkv, D] (io_spec.PLAIN's
layout: the past rows bound in place, the new rows written straight after them)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spork_trt import io_spec
from spork_trt.config import ModelConfig
from spork_trt.engines.kv_cache import Rows
from spork_trt.engines.onnx_engine import bind, bind_rows, session_options


class OnnxHead:
    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        """`cfg`: the head's layer config (HeadConfig.layer_config(): its vocab is the draft vocabulary N)."""
        import onnxruntime as ort

        self.cfg = cfg
        self.session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
        want = [s.name for s in io_spec.head_inputs(cfg)]
        assert [i.name for i in self.session.get_inputs()] == want, (path, want)

    def make_cache(self, max_len: int) -> Rows:
        shape = (1, 1, max_len, self.cfg.n_kv_heads, self.cfg.head_dim)  # [L=1, 1, Smax, Hkv, D]
        return Rows(np.zeros(shape, np.float32), np.zeros(shape, np.float32), axis=2)

    def __call__(self, emb: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 cache: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, g [1, T, C]; position_ids [1, T]; mask [1, T, S], S = the cache's rows + T -> (h [1, T, C], logits
        [1, T, N]); the T new rows are written after the cache's rows (the caller marks them `written`)."""
        t, past = emb.shape[1], cache.length + cache.pending
        assert mask.shape[-1] == past + t, (mask.shape, past)
        if past + t > cache.max_len:
            raise ValueError(f"draft head cache full: {past + t} positions needed, {cache.max_len} allocated")
        h = np.empty((1, t, self.cfg.dim), np.float32)
        logits = np.empty((1, t, self.cfg.vocab_size), np.float32)
        feeds = {"emb": np.ascontiguousarray(emb.numpy(), np.float32), "g": np.ascontiguousarray(g.numpy(), np.float32),
                 "position_ids": np.ascontiguousarray(position_ids.numpy(), np.int64),
                 "attention_mask": np.ascontiguousarray(mask.numpy(), np.bool_)}
        io = self.session.io_binding()
        for name, arr in feeds.items():
            bind(io, name, arr)
        for buf, pname, nname in ((cache.k, "past_key_0", "new_key_0"), (cache.v, "past_value_0", "new_value_0")):
            bind_rows(io, buf[0, 0], pname, nname, past, t)  # [Smax, Hkv, D], contiguous
        bind(io, "h", h, out=True)
        bind(io, "logits", logits, out=True)
        self.session.run_with_iobinding(io)
        return torch.from_numpy(h), torch.from_numpy(logits)
