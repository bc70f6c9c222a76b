"""Weight-only block quantization of ONNX graphs with ONNX Runtime's MatMulNBits (8 or 4 bits, blocks of 32,
symmetric), for quantized self-drafts. accuracy_level 4 lets the CPU kernels compute in int8 (fast); the weights
are what is quantized, activations stay per-block dynamic, which keeps agreement with fp32 high."""
from __future__ import annotations

import logging
from pathlib import Path


def quantize_nbits(src: Path, out: Path, bits: int, block: int = 32, accuracy_level: int = 4) -> Path:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=accuracy_level, bits=bits)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=cfg)
    q.process()
    data = out.with_name(out.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(q.model.model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return out
