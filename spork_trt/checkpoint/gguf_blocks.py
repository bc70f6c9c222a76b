"""A GGUF checkpoint's block-quantized tensors, decoded (codes, scales, offsets), rows in our order: what a target
that computes the checkpoint's own weights runs on (the ONNX build's MatMulNBits, export/gguf_blocks.py; the CPU torch
engine's int4 kernels, engines/cpu/engine.py), instead of requantizing their fp32 dequantization.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spork_trt.errors import UserError
from spork_trt.checkpoint.weights import entries, gguf_reader, unpermute_rope

BLOCK = 32
KEPT = ("Q4_0", "Q4_1", "Q8_0")
INT4_KINDS = ("Q4_0", "Q4_1")  # the kinds a 4-bit kernel computes


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor's blocks, rows in our order (rope rows unpermuted): w[r, j*32:(j+1)*32] = d[r,j] q + m[r,j]."""
    kind: str  # one of KEPT
    codes: np.ndarray  # [rows, K] uint8 (Q4: 0..15; Q8_0: the int8 code + 128)
    d: np.ndarray  # [rows, K/32] float32 scales
    m: np.ndarray | None  # [rows, K/32] float32 offsets (Q4_1), else None

    def dequantized(self) -> np.ndarray:
        """[rows, K] float32, as gguf.quants computes it."""
        rows, k = self.codes.shape
        q = self.codes.reshape(rows, k // BLOCK, BLOCK).astype(np.float32)
        if self.kind == "Q4_0":
            q = q - 8
        elif self.kind == "Q8_0":
            q = q - 128
        w = self.d[..., None] * q
        return (w + self.m[..., None] if self.m is not None else w).reshape(rows, k)


def decode(kind: str, raw: np.ndarray) -> Blocks:
    """raw [rows, bytes per row] uint8 GGUF blocks -> Blocks (ggml's layouts: Q4 keeps elements j and j+16 in the
    low and high nibbles of byte j)."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    b = raw.reshape(rows, -1, size)  # [rows, nb, size]
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(kind, codes.reshape(rows, -1), d, None)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]  # [rows, nb, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32]
    return Blocks(kind, codes.reshape(rows, -1), d, m)


def read_blocks(gguf_path: Path, rope_heads: dict[str, int]) -> dict[str, Blocks]:
    """Every Q4_0 / Q4_1 / Q8_0 tensor of a GGUF file; `rope_heads` names the tensors whose rows llama.cpp
    permuted per head (weights.unpermute_rope), with their head counts."""
    import torch

    out = {}
    for t in gguf_reader(gguf_path).tensors:
        if t.tensor_type.name not in KEPT:
            continue
        blocks = decode(t.tensor_type.name, np.asarray(t.data))
        if t.name in rope_heads:
            rows = blocks.codes.shape[0]
            order = unpermute_rope(torch.arange(rows)[:, None], rope_heads[t.name])[:, 0].numpy()
            blocks = Blocks(blocks.kind, blocks.codes[order], blocks.d[order],
                            None if blocks.m is None else blocks.m[order])
        out[t.name] = blocks
    return out


def rope_heads(cfg) -> dict[str, int]:
    """GGUF tensor name -> head count, for the tensors whose rows llama.cpp permuted per head."""
    return {gg: e.rope_heads(cfg) for e, _, _, gg in entries(cfg) if e.rope_heads is not None}


def blocks_by_parameter(ck, kinds: tuple[str, ...] = KEPT) -> dict[str, Blocks]:
    """Our parameter name -> its kept blocks, for every weight of GGUF checkpoint `ck` stored in one of `kinds`
    ({} for other checkpoints); checked: each one dequantizes to the loaded weight bit for bit."""
    if ck.kind != "gguf":
        return {}
    by_file = read_blocks(ck.path, rope_heads(ck.cfg))
    params = dict(ck.model.named_parameters())
    out = {}
    for _, ours, _, gg in entries(ck.cfg):
        b = by_file.get(gg)
        if b is None or b.kind not in kinds:
            continue
        if not np.array_equal(b.dequantized(), params[ours].detach().float().numpy()):
            raise UserError(f"{ck.path}: {gg}'s blocks do not dequantize to the loaded {ours}")
        out[ours] = b
    return out
