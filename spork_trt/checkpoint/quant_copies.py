"""Quantized copies of a model for self-drafting: no second checkpoint needed.

INT8: per-output-channel symmetric weights with dynamic activation quantization (torch's fbgemm/x86 kernels), so a
draft step reads a quarter of the bytes. INT4: block-wise symmetric (blocks of 32 along the input dim, like GGUF
Q4_0), stored dequantized: torch has no INT4 CPU kernel, so on the torch engine it measures the agreement an INT4
draft would have but runs at fp32 speed (the ONNX Runtime engine runs INT4 natively with MatMulNBits).
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from spork_trt.checkpoint.transformer import Transformer


def int8_copy(model: Transformer) -> Transformer:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)


def int4_blockwise(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize w [O, I] to 4-bit symmetric integers (-8..7) with one scale per `block` inputs."""
    o, i = w.shape
    assert i % block == 0, f"input dim {i} is not a multiple of the INT4 block {block}"
    blocks = w.reshape(o, i // block, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 7.0
    q = torch.clamp(torch.round(blocks / scale.clamp(min=1e-12)), -8, 7)
    return (q * scale).reshape(o, i)


def int4_copy(model: Transformer, block: int = 32) -> Transformer:
    out = copy.deepcopy(model).eval()
    with torch.no_grad():
        for mod in out.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.copy_(int4_blockwise(mod.weight, block))
    return out
