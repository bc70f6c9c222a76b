"""The ONE table of engine inputs and outputs. ONNX export (names, dynamic axes), the ONNX Runtime binding,
TensorRT optimisation profiles and Triton configs all derive from it; a test checks they agree.

KV layout in graphs: [batch, positions, kv_heads, head_dim], so for batch 1 the first P rows of a preallocated
cache are one contiguous block (bound without a copy) and new rows are written straight after them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

# symbolic dims: batch B, new tokens T, past positions P, total S = P + T
BATCH, NEW, PAST, TOTAL = "batch", "new_tokens", "past_len", "total_len"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]


def kv_names(n_layers: int) -> list[tuple[str, str, str, str]]:
    """(past key, past value, new key, new value) names per layer."""
    return [(f"past_key_{i}", f"past_value_{i}", f"new_key_{i}", f"new_value_{i}") for i in range(n_layers)]


def inputs(cfg: ModelConfig, n_layers: int) -> list[TensorSpec]:
    kv = (BATCH, PAST, cfg.n_kv_heads, cfg.head_dim)
    out = [TensorSpec("input_ids", "int64", (BATCH, NEW)), TensorSpec("position_ids", "int64", (BATCH, NEW)),
           TensorSpec("attention_mask", "bool", (BATCH, NEW, TOTAL))]
    for pk, pv, _, _ in kv_names(n_layers):
        out += [TensorSpec(pk, "float32", kv), TensorSpec(pv, "float32", kv)]
    return out


def outputs(cfg: ModelConfig, n_layers: int) -> list[TensorSpec]:
    kv = (BATCH, NEW, cfg.n_kv_heads, cfg.head_dim)
    out = [TensorSpec("logits", "float32", (BATCH, NEW, cfg.vocab_size))]
    for _, _, nk, nv in kv_names(n_layers):
        out += [TensorSpec(nk, "float32", kv), TensorSpec(nv, "float32", kv)]
    return out


def dynamic_axes(specs: list[TensorSpec]) -> dict[str, dict[int, str]]:
    return {s.name: {i: d for i, d in enumerate(s.dims) if isinstance(d, str)} for s in specs}
