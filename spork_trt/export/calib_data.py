"""Calibration feeds for static (QDQ) quantization: real prompts from ../shared/data as prefill inputs of an engine
graph (io_spec names, empty past KV). The LAST prompts of each set are used, so the benches' first `--limit`
prompts stay held out of calibration. Their tokens are cut into windows of one length (long HumanEval prompts split,
short MT-bench ones joined), so every feed has the same shape."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from .. import io_spec
from ..config import ModelConfig
from ..model import causal_mask
from ..prompts import load_prompts
from ..tokenizer import Tokenizer

CALIB_SETS = ("mt_bench", "humaneval")
CALIB_PER_SET = 8  # prompts per set
CALIB_WINDOW = 64  # tokens per feed


def calibration_prompts(per_set: int = CALIB_PER_SET) -> list[str]:
    return [r["prompt"] for name in CALIB_SETS for r in load_prompts(name)[-per_set:]]


def prefill_feed(ids: list[int], cfg: ModelConfig, n_layers: int, attention: str = io_spec.GQA
                 ) -> dict[str, np.ndarray]:
    """One graph input dict: ids as a causal chain with no past rows (GQA: an empty buffer of T positions)."""
    t = len(ids)
    feed = {"input_ids": np.array([ids], np.int64),  # [1, T]
            "position_ids": np.arange(t, dtype=np.int64)[None],  # [1, T]
            "attention_mask": causal_mask(0, t).numpy(),  # [1, T, T]
            "logit_rows": np.arange(t, dtype=np.int64)}  # [R = T]
    if attention == io_spec.GQA:
        feed |= {"query_seqlens": np.array([t], np.int32), "seqlens_k": np.array([t - 1], np.int32),
                 "total_sequence_length": np.array(t, np.int32)}
        empty = np.zeros((1, cfg.n_kv_heads, t, cfg.head_dim), np.float32)  # [1, Hkv, M=T, D]
    else:
        empty = np.zeros((1, 0, cfg.n_kv_heads, cfg.head_dim), np.float32)  # [1, P=0, Hkv, D]
    for pk, pv, _, _ in io_spec.kv_names(n_layers, attention):
        feed[pk], feed[pv] = empty, empty
    return feed


def calibration_feeds(tok: Tokenizer, cfg: ModelConfig, n_layers: int, attention: str = io_spec.GQA,
                      per_set: int = CALIB_PER_SET) -> list[dict[str, np.ndarray]]:
    stream = [t for p in calibration_prompts(per_set) for t in tok.encode_prompt(p)]
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
