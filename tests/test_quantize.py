"""Every quantized copy `python -m export build` can make, on a tiny seeded random model: the graph carries the
quantized ops it claims (MatMulNBits, MatMulInteger, INT8 and FP8 Q/DQ), runs on ONNX Runtime with io_spec's
inputs and outputs, stays close to fp32, and as a draft keeps spork's output identical to plain greedy."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.draft_kinds import QUANTS
from spork_trt.spec.drafters import ModelDrafter
from spork_trt.engines import forward_chain
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.export.calib_data import prefill_feed
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.export.quantize import int8_matmuls, quantize, weight_matmuls
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

CFG = tiny_config(vocab_size=64, n_layers=3, dim=64)
IDS = [3, 9, 27, 17, 51, 25, 11, 40, 33, 2, 8, 60]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    model = random_checkpoint(CFG, seed=21, scale=8.0).model
    fp32 = export_onnx(model, d / "target.onnx")
    rng = np.random.default_rng(0)
    feeds = lambda: [prefill_feed(rng.integers(0, 64, 16).tolist(), CFG, CFG.n_layers) for _ in range(4)]  # noqa: E731
    graphs = {q: quantize(q, fp32, d / f"{q}.onnx", feeds) for q in QUANTS}
    return model, fp32, graphs


def ops(path) -> Counter:
    g = onnx.load(str(path), load_external_data=False).graph
    return Counter(n.op_type for n in g.node)


def q_types(path) -> set[int]:
    """Element types of the QuantizeLinear zero points (the quantized activation type)."""
    g = onnx.load(str(path), load_external_data=False).graph
    zp = {i.name: i.data_type for i in g.initializer}
    return {zp[n.input[2]] for n in g.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}


def test_graphs_carry_their_quantized_ops(tiny):
    _, fp32, graphs = tiny
    n_weights = len(weight_matmuls(fp32))
    assert n_weights == 4 * CFG.n_layers + 1  # q|k|v, o, gate|up, down per layer (fused by lean.py) and the LM head
    assert ops(graphs["int8"])["MatMulNBits"] == ops(graphs["int4"])["MatMulNBits"] == n_weights
    assert ops(graphs["int8-dynamic"])["MatMulInteger"] == len(int8_matmuls(fp32)) == n_weights - CFG.n_layers
    assert q_types(graphs["int8-static"]) == {onnx.TensorProto.INT8}
    assert q_types(graphs["fp8"]) == {onnx.TensorProto.FLOAT8E4M3FN}
    assert ops(graphs["fp8"])["DequantizeLinear"] > n_weights  # every weight and every distinct activation


@pytest.mark.parametrize("q", QUANTS)
def test_quantized_graph_runs_close_to_fp32(tiny, q):
    model, _, graphs = tiny
    want = forward_chain(*_ready(TorchEngine(model)), IDS)
    got = forward_chain(*_ready(OnnxEngine(graphs[q], CFG)), IDS)
    assert got.shape == want.shape == (len(IDS), CFG.vocab_size)
    rel = ((got - want).norm() / want.norm()).item()
    # seeded and deterministic: int8 0.03, int8-dynamic 0.06, int8-static 0.16, fp8 0.16, int4 0.41 (4 bits on random
    # weights); a broken scale or axis gives ~1 and chance agreement (1/64)
    assert rel < 0.5, (q, rel)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


def _ready(engine):
    return engine, engine.make_cache(64)


@pytest.mark.parametrize("q", ["int8-dynamic", "int8-static", "fp8"])
def test_quantized_draft_is_lossless(tiny, q):
    model, fp32, graphs = tiny
    cfg = GenerateConfig(max_new_tokens=40, sampling=SamplingConfig())
    want = generate(TorchEngine(model), [1, 2, 3, 4], cfg, frozenset()).token_ids
    drafter = ModelDrafter(OnnxEngine(graphs[q], CFG), SamplingConfig(), torch.Generator())
    got = generate(OnnxEngine(fp32, CFG), [1, 2, 3, 4], cfg, frozenset(), drafter=drafter,
                   spec=SpecConfig(tree_width=2, tree_depth=3, tree_budget=6))
    assert got.token_ids == want


def test_calibration_prompts_are_stdlib_functions_never_benchmark_text():
    from spork_trt.export.calib_data import CALIB_PROMPTS, calibration_prompts
    from spork_trt.export.code_prompts import CODE_PREFIX
    from spork_trt.prompts import load_prompts

    got = calibration_prompts()
    assert len(got) == CALIB_PROMPTS and got == calibration_prompts()  # deterministic
    assert all(p.startswith(CODE_PREFIX + "def ") for p in got)
    bench = [r["prompt"] for name in ("mt_bench", "humaneval") for r in load_prompts(name)]
    assert not any(p in b or b in p for p in got for b in bench)
