"""FP8 (E4M3FN) Q/DQ graphs the way TensorRT and NVIDIA ModelOpt build them: per-tensor scales from the absolute
maximum (amax / 448), activations calibrated on real prompts, weights stored as float8 behind a DequantizeLinear.

onnxruntime.quantization's own FP8 mode only offers Distribution calibration, whose std-matched scales saturate
the activation outliers of a language model (top-1 agreement with fp32 near 0 on the default model), so the
Q/DQ pairs are inserted here; ONNX Runtime's MinMax calibrator supplies the activation ranges."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

E4M3_MAX = 448.0
OPSET = 19  # QuantizeLinear / DequantizeLinear on float8


def activation_amax(src: Path, feeds: list[dict]) -> dict[str, float]:
    """Absolute maximum of every MatMul input over the calibration feeds."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from spork_trt.export.calib_data import FeedReader

    with tempfile.TemporaryDirectory(prefix="spork-fp8-") as tmp:
        cal = create_calibrator(src, ["MatMul"], augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
                                providers=["CPUExecutionProvider"], extra_options={"symmetric": True})
        cal.collect_data(FeedReader(feeds))
        ranges = cal.compute_data()
    return {name: float(np.abs(np.asarray(d.range_value, np.float64)).max()) for name, d in ranges.items()}


def quantize_fp8(src: Path, out: Path, feeds: list[dict], nodes: list[str]) -> Path:
    """src fp32 graph -> out: the MatMuls named in `nodes` (constant weight second input) read FP8 Q/DQ inputs."""
    import ml_dtypes
    import onnx
    from onnx import helper, numpy_helper, version_converter

    amax = activation_amax(src, feeds)
    model = version_converter.convert_version(onnx.load(str(src)), OPSET)  # ReduceMean's axes become an input
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    zero = helper.make_tensor("fp8_zero", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])
    g.initializer.append(zero)
    new_nodes: dict[str, list] = {}  # MatMul name -> the Q/DQ nodes to put before it
    done: dict[str, str] = {}  # activation -> its dequantized name (q, k and v share one input)
    wanted = set(nodes)
    for n in (n for n in g.node if n.name in wanted):
        x, w = n.input[0], n.input[1]
        if x not in done:
            assert x in amax, f"no calibrated range for {x}"
            scale = scalar(f"{x}_fp8_scale", max(amax[x], 1e-6) / E4M3_MAX)
            g.initializer.append(scale)
            new_nodes[n.name] = [
                helper.make_node("QuantizeLinear", [x, scale.name, zero.name], [f"{x}_fp8"], f"{x}_fp8_q"),
                helper.make_node("DequantizeLinear", [f"{x}_fp8", scale.name, zero.name], [f"{x}_fp8_dq"],
                                 f"{x}_fp8_dq")]
            done[x] = f"{x}_fp8_dq"
        wf = numpy_helper.to_array(inits[w])  # [K, N]
        s = max(float(np.abs(wf).max()), 1e-12) / E4M3_MAX
        wq = numpy_helper.from_array((wf / s).astype(ml_dtypes.float8_e4m3fn), f"{w}_fp8")
        g.initializer.remove(inits[w])
        g.initializer.extend([wq, scalar(f"{w}_fp8_scale", s)])
        new_nodes.setdefault(n.name, []).append(
            helper.make_node("DequantizeLinear", [wq.name, f"{w}_fp8_scale", zero.name], [f"{w}_fp8_dq"],
                             f"{w}_fp8_dq"))
        n.input[0], n.input[1] = done[x], f"{w}_fp8_dq"
    ordered = []
    for n in g.node:  # each Q/DQ right before its MatMul keeps the graph topologically sorted
        ordered += new_nodes.get(n.name, []) + [n]
    del g.node[:]
    g.node.extend(ordered)
    from spork_trt.export.quantize import save_external

    return save_external(model, out)


def scalar(name: str, value: float):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(value, np.float32), name)
