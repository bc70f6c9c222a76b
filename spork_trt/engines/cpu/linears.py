"""The CPU torch engine's weight kernels: nn.Linear replaced by a prepacked bf16 oneDNN matmul or, where the
checkpoint stores the weight as 4-bit blocks (GGUF Q4_0 / Q4_1), by a 4-bit kernel over those blocks.

  PackedLinear  w in bf16, reordered once into oneDNN's blocked layout (what inductor's freezing does). oneDNN takes
                another kernel for one row than for two or more: callers run at least two rows (engines/cpu/engine.py).
  Int4Linear    the checkpoint's own 4-bit codes: w = d q + off per block of 32 with its fp16 d and off, bf16
                activations, fp32 sums, on spork::int4_mm (engines/cpu/avx512_matmul.cpp, AVX512-BF16: each block's codes
                expanded once for all rows; 1.4x ATen's int4 kernel at one row, 1.7x at 16, 2.3x at 64 and more,
                docs/engines.md) or, where that is not built, ATen's `_weight_int4pack_mm_for_cpu` (what torchao's
                int4 weight-only layout runs on a CPU; s and z rounded to bf16). Both compute every row alone: a row
                gives the same bits at any row count (tests/test_int4_kernel.py, tests/test_onednn_engine.py).
  Q8Linear      the LM head on the checkpoint's own Q8_0 blocks (w = d q, q int8) with fp32 logits, on spork::q8_mm
                (the same kernel, 8-bit codes): half the bytes of bf16 and one row where oneDNN ran two. Only where
                spork's kernels are built; else the head stays a PackedLinear.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from spork_trt.errors import UserError
from spork_trt.checkpoint.gguf_blocks import BLOCK, INT4_KINDS, KEPT, Blocks
from spork_trt.checkpoint.transformer import MLP, Attention
from spork_trt.engines.cpu import kernels as int4_kernel

PACK_ROWS = 2  # the row count oneDNN's weight layout is chosen for
NO_SCALES = torch.empty(0)  # a PackedLinear's `scales`: its weight is bf16


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
           wide: bool = False) -> torch.Tensor:
    """x [N, in] bf16 -> [N, out] bf16 (fp32 with `wide` on spork::int4_mm: a sum into the fp32 residual stream): a
    PackedLinear's weight (`scales` empty) or an Int4Linear's blocks of `group` weights. TorchScript-compatible:
    engines/cpu/forward.py runs it inside its scripted layers."""
    if scales.numel() == 0:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if scales.dtype == torch.float16 or scales.dtype == torch.float32:  # packed for spork::int4_mm (cpu/kernels.py)
        return torch.ops.spork.int4_mm(x, packed, scales, wide)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales)


def onednn_bf16_available() -> bool:
    """Whether this CPU and torch build have oneDNN's bf16 kernels (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def require_onednn() -> None:
    if not onednn_bf16_available():
        raise UserError("--device cpu --dtype bf16 needs oneDNN's bf16 kernels (a CPU with AVX512-BF16 or AMX, and a "
                        "torch build with oneDNN), and so does --dtype int4 for any weight outside the checkpoint's "
                        "4-bit blocks and Q8_0 head (or everywhere, where spork's CPU kernels are not built): this CPU "
                        "has none; use --dtype fp32 or the ONNX engines")


class PackedLinear(nn.Module):
    """nn.Linear (no bias) with its bf16 weight reordered once into oneDNN's layout."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        require_onednn()
        w = weight.detach().to(torch.bfloat16)  # [out, in]
        self.out_features = w.shape[0]
        self.weight_numel = w.numel()
        self.weight_bytes = 2 * w.numel()  # what a forward reads
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        self.scales = NO_SCALES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        y = matmul(x.reshape(-1, x.shape[-1]), self.packed, self.scales, BLOCK)
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """nn.Linear (no bias) computing a checkpoint's blocks: on spork's kernel any kind it holds (gguf_blocks.KINDS:
    4-bit Q4_0 / Q4_1 / Q4_K codes, 8-bit codes for Q5_0 / Q5_1 / Q5_K / Q8_0), else Q4_0 / Q4_1 on ATen's int4 CPU
    kernel (`computes`)."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        assert computes(blocks.kind), blocks.kind
        self.out_features = blocks.codes.shape[0]
        if int4_kernel.kernel() == "spork":  # w = d (c - shift) + m exactly: off = m, or -shift d
            off = blocks.m if blocks.m is not None else -blocks.spec.shift * blocks.d
            self.packed, self.scales = int4_kernel.pack(blocks.codes, blocks.d, off, blocks.spec.bits,
                                                        blocks.spec.fp16)
        else:
            codes = torch.from_numpy(blocks.codes.astype(np.int32))  # [N, K] in 0..15
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            d = torch.from_numpy(blocks.d)  # [N, K/32]
            z = torch.from_numpy(blocks.m) + 8 * d if blocks.m is not None else torch.zeros_like(d)
            self.scales = torch.stack([d.t(), z.t()], -1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.weight_numel = blocks.codes.size
        self.weight_bytes = self.packed.nbytes + self.scales.nbytes  # what a forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] bf16."""
        y = matmul(x.reshape(-1, x.shape[-1]), self.packed, self.scales, BLOCK)
        return y.view(*x.shape[:-1], self.out_features)


class Q8Linear(nn.Module):
    """nn.Linear (no bias) computing a checkpoint's Q8_0 blocks on spork::q8_mm, fp32 out."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        assert blocks.kind == "Q8_0" and int4_kernel.kernel() == "spork", (blocks.kind, int4_kernel.kernel())
        self.out_features = blocks.codes.shape[0]
        self.packed, self.scales = int4_kernel.pack(blocks.codes, blocks.d, -128 * blocks.d, bits=8)  # w = d (c - 128)
        self.weight_numel = blocks.codes.size
        self.weight_bytes = self.packed.nbytes + self.scales.nbytes  # what a forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] fp32."""
        y = torch.ops.spork.q8_mm(x.reshape(-1, x.shape[-1]), self.packed, self.scales)
        return y.view(*x.shape[:-1], self.out_features)


FUSED = ((Attention, "wqkv", ("wq", "wk", "wv")), (MLP, "gate_up", ("gate", "up")))  # one matmul for several


def computes(kind: str) -> bool:
    """Whether this process's block kernel computes `kind` on its own blocks: spork's every kind gguf_blocks keeps,
    ATen's Q4_0 / Q4_1."""
    return kind in (KEPT if int4_kernel.kernel() == "spork" else INT4_KINDS)


def fused_blocks(parts: list[Blocks | None]) -> Blocks | None:
    """The blocks of the projections `parts` stacked by output row, when all are blocks of one kind (or, on spork's
    kernel, of kinds of one code width: their codes shifted, their scales as fp32 where one kind needs it)."""
    if any(p is None or not computes(p.kind) for p in parts):
        return None
    mixed = len({p.kind for p in parts}) != 1
    if mixed and (int4_kernel.kernel() != "spork" or len({p.spec.bits for p in parts}) != 1):
        return None
    cat = lambda arrays: np.concatenate(arrays, axis=0)  # noqa: E731
    if not mixed:
        return Blocks(parts[0].kind, cat([p.codes for p in parts]), cat([p.d for p in parts]),
                      None if parts[0].m is None else cat([p.m for p in parts]))
    offs = [p.m if p.m is not None else -p.spec.shift * p.d for p in parts]  # w = d c + off for each
    kind = next((p.kind for p in parts if not p.spec.fp16), None) or ("Q4_1" if parts[0].spec.bits == 4 else "Q5_1")
    return Blocks(kind, cat([p.codes for p in parts]), cat([p.d for p in parts]), cat(offs))


def pack_linears(model: nn.Module, blocks: dict[str, Blocks], prefix: str = "") -> None:
    """Replace every nn.Linear of `model` in place: by an Int4Linear where `blocks` (parameter name -> the
    checkpoint's blocks) holds its weight in 4 bits (q, k and v as one, gate and up as one: FUSED; each output
    column is the same dot product either way), else by a PackedLinear (a tied LM head gets its own copy)."""
    for kind, fused, names in FUSED:
        if isinstance(model, kind):
            kept = fused_blocks([blocks.get(f"{prefix}{n}.weight") for n in names])
            if kept is not None:
                setattr(model, fused, Int4Linear(kept))
                for n in names:
                    setattr(model, n, None)
    for name, child in list(model.named_children()):
        weight = f"{prefix}{name}.weight"
        if isinstance(child, nn.Linear):
            kept = blocks.get(weight)
            setattr(model, name, Int4Linear(kept) if kept is not None and computes(kept.kind)
                    else PackedLinear(child.weight))
        else:
            pack_linears(child, blocks, f"{prefix}{name}.")
