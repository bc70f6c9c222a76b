"""A GGUF checkpoint's block-quantized tensors, decoded (codes, scales, offsets), rows in our order: what a target
that computes the checkpoint's own weights runs on (the ONNX build's MatMulNBits, export/gguf_blocks.py; the CPU torch
engine's int4 kernels, engines/cpu/engine.py), instead of requantizing their fp32 dequantization.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spork_trt.errors import UserError
from spork_trt.checkpoint.families import GGUF_PERMUTED_QK
from spork_trt.checkpoint.weights import entries, gguf_reader, unpermute_rope

BLOCK = 32


@dataclass(frozen=True)
class Kind:
    """How a GGUF block type is held: as codes of `bits` (4, or 8 for a byte per code: 5-bit and 8-bit codes alike)
    in blocks of 32 with a scale d and an offset each (w = d (c - shift) + m), exactly the file's weights."""
    bits: int
    shift: int  # subtracted from the codes where the block has no offset of its own (Q4_0 8, Q5_0 16, Q8_0 128)
    fp16: bool  # its d and offsets are fp16 values (the kernels' fp16 scales); else fp32 (a K-quant's d times its
    # sub-block's 6-bit scale: exact in fp32, not in fp16)


KINDS = {"Q4_0": Kind(4, 8, True), "Q4_1": Kind(4, 0, True), "Q4_K": Kind(4, 0, False),
         "Q5_0": Kind(8, 16, True), "Q5_1": Kind(8, 0, True), "Q5_K": Kind(8, 0, False), "Q8_0": Kind(8, 128, True)}
KEPT = tuple(KINDS)  # every type read as blocks (Q6_K's 16-weight sub-blocks are not: its weights run in bf16)
INT4_KINDS = ("Q4_0", "Q4_1")  # the kinds ATen's int4 kernel computes (fp16 scales, 4-bit codes)
SIZES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176}  # bytes per block
K_BLOCK = 256  # weights per K-quant super-block (8 sub-blocks of 32)


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor's blocks, rows in our order (rope rows unpermuted): w[r, j*32:(j+1)*32] = d[r,j] (q - shift)
    + m[r,j], the code q and the shift as KINDS[kind] says."""
    kind: str  # one of KEPT
    codes: np.ndarray  # [rows, K] uint8 (Q4: 0..15; Q5: 0..31; Q8_0: the int8 code + 128)
    d: np.ndarray  # [rows, K/32] float32 scales
    m: np.ndarray | None  # [rows, K/32] float32 offsets (Q4_1, Q5_1, K-quants: minus dmin times the 6-bit min)

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    def dequantized(self) -> np.ndarray:
        """[rows, K] float32, as gguf.quants computes it (bit for bit: tests/test_gguf_blocks.py)."""
        rows, k = self.codes.shape
        q = self.codes.reshape(rows, k // BLOCK, BLOCK).astype(np.float32) - self.spec.shift
        w = self.d[..., None] * q
        return (w + self.m[..., None] if self.m is not None else w).reshape(rows, k)


def decode(kind: str, raw: np.ndarray) -> Blocks:
    """raw [rows, bytes per row] uint8 GGUF blocks -> Blocks (ggml's layouts: Q4/Q5 keep elements j and j+16 of a
    block in the low and high nibbles of byte j, Q5's fifth bits in a 32-bit word; a K-quant super-block keeps
    sub-blocks 2i and 2i+1 in the low and high nibbles of its 32 bytes i, its 6-bit scales and mins packed in 12
    bytes, gguf.quants.Q4_K.get_scale_min)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, SIZES[kind])  # [rows, nb, size]
    half = lambda at: b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if kind in ("Q4_K", "Q5_K"):
        return decode_k(kind, b, half(0), half(2))
    d = half(0)
    if kind == "Q8_0":
        codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(kind, codes.reshape(rows, -1), d, None)
    m = half(2) if kind in ("Q4_1", "Q5_1") else None
    at = 4 if m is not None else 2
    if kind in ("Q5_0", "Q5_1"):
        qh = b[..., at:at + 4].copy().view(np.uint32)  # [rows, nb, 1]: bit i is element i's fifth bit
        at += 4
    qs = b[..., at:]  # [rows, nb, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32]
    if kind in ("Q5_0", "Q5_1"):
        codes = codes | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    return Blocks(kind, codes.reshape(rows, -1), d, m)


def decode_k(kind: str, b: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> Blocks:
    """Q4_K / Q5_K super-blocks b [rows, nb, size] (d, dmin [rows, nb]) -> Blocks of 32: d x scale and -dmin x min
    per sub-block, in fp32 as ggml computes them."""
    from gguf.quants import Q4_K

    rows, nb, _ = b.shape
    sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))  # [rows * nb, 8] each
    ds = (d.reshape(-1, 1) * sc.astype(np.float32)).reshape(rows, nb * 8)
    ms = -(dmin.reshape(-1, 1) * mn.astype(np.float32)).reshape(rows, nb * 8)
    qs = b[..., -128:].reshape(rows, nb, 4, 1, 32)  # the low 4 bits: 32 bytes per pair of sub-blocks
    codes = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(rows, nb, 8, 32)
    if kind == "Q5_K":
        qh = b[..., 16:48].reshape(rows, nb, 1, 32)  # bit j of byte i: element i of sub-block j's fifth bit
        codes = codes | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1) << 4)
    return Blocks(kind, codes.reshape(rows, -1).astype(np.uint8), ds, ms)


def read_blocks(gguf_path: Path, rope_heads: dict[str, int], kinds: tuple[str, ...] = KEPT) -> dict[str, Blocks]:
    """Every tensor of a GGUF file stored in one of `kinds`; `rope_heads` names the tensors whose rows llama.cpp
    permuted per head (weights.unpermute_rope), with their head counts."""
    import torch

    out = {}
    for t in gguf_reader(gguf_path).tensors:
        if t.tensor_type.name not in kinds:
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
    if cfg.arch.family not in GGUF_PERMUTED_QK:
        return {}
    return {gg: e.rope_heads(cfg) for e, _, _, gg in entries(cfg) if e.rope_heads is not None}


def split_fused(cfg, blocks: dict[str, Blocks]) -> dict[str, Blocks]:
    """Phi-3's fused q/k/v and gate/up tensors split by output row into the tensors LAYOUT names, as
    weights.unfuse splits the loaded weights (each row's blocks are that row's)."""
    from spork_trt.checkpoint.weights import FUSED

    for _, fused, _, parts, rows in FUSED:
        for i in range(cfg.n_layers):
            b = blocks.get(fused.format(i=i))
            if b is None or b.codes.shape[0] != sum(rows(cfg)) or (fused.endswith("ffn_up.weight")
                                                                  and f"blk.{i}.ffn_gate.weight" in blocks):
                continue
            del blocks[fused.format(i=i)]
            at = np.cumsum(rows(cfg))[:-1]
            pieces = zip(*(np.split(a, at) if a is not None else [None] * len(parts) for a in (b.codes, b.d, b.m)))
            blocks |= {part.format(i=i): Blocks(b.kind, c, d, m) for part, (c, d, m) in zip(parts, pieces)}
    return blocks


def blocks_by_parameter(ck, kinds: tuple[str, ...] = KEPT) -> dict[str, Blocks]:
    """Our parameter name -> its kept blocks, for every weight of GGUF checkpoint `ck` stored in one of `kinds`
    ({} for other checkpoints); checked: each one dequantizes to the loaded weight bit for bit."""
    if ck.kind != "gguf":
        return {}
    by_file = split_fused(ck.cfg, read_blocks(ck.path, rope_heads(ck.cfg), kinds))
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
