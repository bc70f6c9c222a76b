"""Calibration feeds for static (QDQ) quantization: prompts as prefill inputs of an engine graph (io_spec names,
empty past KV). The prompts are function-completion prompts (signature + docstring: code and prose) from this
Python's standard library, never benchmark text (a quantized copy calibrated on the benchmarks' prompts would be
measured on what it was fitted to). Their tokens are cut into windows of one length, so every feed has the same
shape."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from spork_trt import io_spec
from spork_trt.config import ModelConfig
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.tokenizer import Tokenizer
from spork_trt.export.code_prompts import stdlib_candidates

CALIB_PROMPTS = 16  # stdlib function prompts
CALIB_WINDOW = 64  # tokens per feed
CALIB_SEED = 7  # their choice (selfdata's stdlib prompts use another seed's order: data and calibration differ)
CALIB_CHARS = 1500  # longest prompt taken, in characters


def calibration_prompts(n: int = CALIB_PROMPTS) -> list[str]:
    return [f["prompt"] for f in stdlib_candidates(CALIB_SEED) if len(f["prompt"]) <= CALIB_CHARS][:n]


def prefill_feed(ids: list[int], cfg: ModelConfig, n_layers: int, attention: str = io_spec.GQA
                 ) -> dict[str, np.ndarray]:
    """One graph input dict: ids as a causal chain with no past rows (GQA: an empty buffer of T positions)."""
    t = len(ids)
    feed = {"input_ids": np.array([ids], np.int64),  # [1, T]
            "position_ids": np.arange(t, dtype=np.int64)[None],  # [1, T]
            "attention_mask": causal_mask(0, t).numpy(),  # [1, T, T]
            "logit_rows": np.arange(t, dtype=np.int64)}  # [R = T]
    if attention == io_spec.GQA:
        feed |= io_spec.gqa_feeds([t], [0], t)
        empty = np.zeros((1, cfg.n_kv_heads, t, cfg.head_dim), np.float32)  # [1, Hkv, M=T, D]
    else:
        empty = np.zeros((1, 0, cfg.n_kv_heads, cfg.head_dim), np.float32)  # [1, P=0, Hkv, D]
    for pk, pv, _, _ in io_spec.kv_names(n_layers, attention):
        feed[pk], feed[pv] = empty, empty
    return feed


def calibration_feeds(tok: Tokenizer, cfg: ModelConfig, n_layers: int, attention: str = io_spec.GQA,
                      n: int = CALIB_PROMPTS) -> list[dict[str, np.ndarray]]:
    stream = [t for p in calibration_prompts(n) for t in tok.encode_prompt(p)]
    w = CALIB_WINDOW
    return [prefill_feed(stream[i:i + w], cfg, n_layers, attention) for i in range(0, len(stream) - w + 1, w)]


class FeedReader(CalibrationDataReader):
    """onnxruntime.quantization's calibration reader over prepared feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self.it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)

    def rewind(self) -> None:
        self.it = iter(self.feeds)
