"""Quantized copies of an fp32 ONNX graph, all with onnxruntime.quantization, all runnable on ONNX Runtime CPU:

  int8, int4     weight-only block quantization (MatMulNBits, blocks of 32, symmetric); accuracy_level 4 lets the
                 CPU kernels compute in int8. The fast self-drafts on CPU.
  int8-dynamic   quantize_dynamic: per-tensor INT8 weights, activations quantized per tensor at run time
                 (MatMulInteger). (Per-channel weights gave 0.0 top-1 agreement here: wrong axis for MatMul.)
  int8-static    quantize_static, QDQ format, TensorRT style: per-channel symmetric INT8 weights, per-tensor
                 symmetric INT8 activations with ranges calibrated (MinMax) on stdlib prompts (calib_data.py).
  fp8            FP8 E4M3FN Q/DQ, amax-calibrated on the same prompts (fp8.py); opset 19. Intended for TensorRT
                 on Hopper+ GPUs; on CPU ONNX Runtime runs the Q/DQ pairs in float: it measures FP8's agreement,
                 not its speed.

Only MatMuls with constant weights (projections, MLP, LM head) are quantized; attention's activation x activation
MatMuls stay fp32, and the INT8 activation modes keep the MLP down projections fp32 (int8_matmuls)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from spork_trt.draft_kinds import QUANTS


def quantize(kind: str, src: Path, out: Path, feeds: Callable[[], list[dict]] | None = None) -> Path:
    """src (fp32 .onnx with external data) -> out (+ out.data); `feeds` builds the calibration inputs."""
    assert kind in QUANTS, kind
    with quiet():
        return run_quantizer(kind, src, out, feeds)


@contextmanager
def quiet() -> Iterator[None]:
    """onnxruntime.quantization logs notices on the root logger ("consider pre-processing") and per node on the
    MatMulNBits quantizer's own INFO logger: mute both while quantizing."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_quantizer(kind: str, src: Path, out: Path, feeds: Callable[[], list[dict]] | None) -> Path:
    data = out.with_name(out.name + ".data")
    if data.exists():
        data.unlink()
    if kind in ("int8", "int4"):
        return quantize_nbits(src, out, bits=8 if kind == "int8" else 4)
    if kind == "int8-dynamic":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(src, out, weight_type=QuantType.QInt8, per_channel=False, op_types_to_quantize=["MatMul"],
                         nodes_to_quantize=int8_matmuls(src), use_external_data_format=True)
        return out
    assert feeds is not None, f"{kind} needs calibration feeds"
    if kind == "fp8":
        from spork_trt.export.fp8 import quantize_fp8

        return quantize_fp8(src, out, feeds(), weight_matmuls(src))
    return quantize_static_int8(src, out, feeds())


def quantize_nbits(src: Path, out: Path, bits: int, block: int = 32, accuracy_level: int = 4,
                   exclude: list[str] | None = None) -> Path:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    cfg = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=accuracy_level, bits=bits)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=cfg, nodes_to_exclude=exclude or [])
    q.process()
    return save_external(q.model.model, out)


def save_external(model, out: Path) -> Path:
    """Save an ONNX model with its weights in one external file, out + ".data" (the layout every engine uses)."""
    import onnx

    onnx.save_model(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=1024)
    return out


def quantize_static_int8(src: Path, out: Path, feeds: list[dict]) -> Path:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from spork_trt.export.calib_data import FeedReader

    quantize_static(src, out, FeedReader(feeds), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    nodes_to_quantize=int8_matmuls(src), activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, per_channel=True, use_external_data_format=True,
                    calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                   "CalibTensorRangeSymmetric": True},
                    calibration_providers=["CPUExecutionProvider"])
    return out


def weight_matmuls(src: Path) -> list[str]:
    """Names of the MatMul nodes whose second input is a constant weight."""
    import onnx

    g = onnx.load(str(src), load_external_data=False).graph
    inits = {i.name for i in g.initializer}
    return [n.name for n in g.node if n.op_type == "MatMul" and n.input[1] in inits]


def int8_matmuls(src: Path) -> list[str]:
    """weight_matmuls less the MLP down projections: their input (after SwiGLU) has outliers that one per-tensor
    INT8 scale cannot hold (top-1 agreement with fp32 0.30 with them, 0.78 without, int8-static, default model)."""
    return [n for n in weight_matmuls(src) if "/mlp/down/" not in n]
