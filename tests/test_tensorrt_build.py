"""The TensorRT build path on CPU: the optimisation profile derived from io_spec, the Q/DQ check, the KV alignment
step, and the runtime check that stops a host without tensorrt or a GPU. Building and running plans needs a GPU host."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from spork_trt import io_spec
from spork_trt.engines.trt_engine import align_rows, require_tensorrt
from spork_trt.errors import UserError
from spork_trt.export.tensorrt import TrtBuildConfig, build_plan, profile_shapes, qdq_nodes
from tests.conftest import tiny_config

# the embedded default's shapes (SmolLM2-135M: 30 layers, 3 KV heads of 64) and the tests' tiny model; no weights
SHAPES = {"default": tiny_config(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                 max_seq_len=8192),
          "tiny": tiny_config()}
NO_TENSORRT = importlib.util.find_spec("tensorrt") is None


@pytest.mark.parametrize("which", SHAPES)
def test_profile_follows_io_spec(which):
    cfg = SHAPES[which]
    s = cfg.max_seq_len + TrtBuildConfig.spare_positions  # the context window and a draft tree past it
    so = min(512, s)  # opt_seq_len, clamped
    limits = TrtBuildConfig(max_new_tokens=64).limits(cfg.max_seq_len)
    shapes = profile_shapes(io_spec.inputs(cfg, cfg.n_layers), limits)
    assert list(shapes) == [spec.name for spec in io_spec.inputs(cfg, cfg.n_layers)]
    assert len(shapes) == 4 + 2 * cfg.n_layers
    assert shapes["input_ids"] == shapes["position_ids"] == ((1, 1), (1, 8), (1, 64))
    assert shapes["logit_rows"] == ((1,), (8,), (64,))  # max batch 1 x max new tokens
    assert shapes["attention_mask"] == ((1, 1, 1), (1, 8, so), (1, 64, s))
    kv = cfg.n_kv_heads, cfg.head_dim
    for pk, pv, _, _ in io_spec.kv_names(cfg.n_layers):
        assert shapes[pk] == shapes[pv] == ((1, 0, *kv), (1, so - 8, *kv), (1, s - 1, *kv))
    for lo, opt, hi in shapes.values():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    _, opt_ids, _ = shapes["input_ids"]
    _, opt_mask, _ = shapes["attention_mask"]
    assert opt_mask[2] == shapes["past_key_0"][1][1] + opt_ids[1]  # one consistent forward: S = P + T


def test_limits_fit_a_short_context():
    limits = TrtBuildConfig(max_new_tokens=64, opt_seq_len=512, max_seq_len=12, spare_positions=4).limits(8192)
    assert limits == {io_spec.BATCH: (1, 1, 1), io_spec.NEW: (1, 8, 16), io_spec.PAST: (0, 8, 15),
                      io_spec.TOTAL: (1, 16, 16), io_spec.ROWS: (1, 8, 16)}


def test_profile_keeps_fixed_dims():
    spec = io_spec.TensorSpec("x", "float32", (io_spec.BATCH, 7))
    assert profile_shapes([spec], TrtBuildConfig(max_batch=4).limits(32))["x"] == ((1, 7), (1, 7), (4, 7))


def test_record_is_json_ready():
    rec = json.loads(json.dumps(TrtBuildConfig(precision="int8-static", spare_positions=0).record(2048)))
    assert rec["precision"] == "int8-static" and rec["strongly_typed"] is True
    assert rec["profile"][io_spec.TOTAL] == [1, 512, 2048]


def test_unknown_precision_is_refused():
    with pytest.raises(UserError, match="int4"):
        TrtBuildConfig(precision="int4")


def test_kv_rows_keep_addresses_aligned():
    assert align_rows(3 * 64 * 4) == 1  # the default's fp32 rows (768 bytes): every row offset is aligned
    assert align_rows(3 * 64 * 2) == 2  # its fp16 rows: every other one
    assert align_rows(2 * 16 * 4) == 2 and align_rows(1 * 4 * 2) == 32  # tiny rows


def qdq_graph(path: Path, quantized: bool) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [0.1])
    zero = helper.make_tensor("zero", TensorProto.INT8, [], [0])
    nodes = ([helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
              helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"])] if quantized
             else [helper.make_node("Identity", ["x"], ["y"])])
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], [scale, zero])), str(path))
    return path


def test_qdq_nodes_are_counted(tmp_path):
    assert qdq_nodes(qdq_graph(tmp_path / "q.onnx", quantized=True)) == 2
    assert qdq_nodes(qdq_graph(tmp_path / "plain.onnx", quantized=False)) == 0


@pytest.mark.skipif(not NO_TENSORRT, reason="checks what a host without tensorrt is told; tensorrt is installed here")
def test_require_tensorrt_names_the_missing_package(tmp_path):
    with pytest.raises(UserError, match="`tensorrt` Python package"):
        require_tensorrt()
    cfg = SHAPES["tiny"]
    with pytest.raises(UserError, match="tensorrt"):
        build_plan(tmp_path / "none.onnx", tmp_path / "none.plan", TrtBuildConfig(), cfg, cfg.n_layers)
    assert not (tmp_path / "none.plan").exists()


@pytest.mark.skipif(not NO_TENSORRT, reason="checks what a host without tensorrt is told; tensorrt is installed here")
def test_a_manifest_plan_entry_loads_through_tensorrt(tmp_path):
    from spork_trt.engines import load_engine

    with pytest.raises(UserError, match="`tensorrt` Python package"):
        load_engine(tmp_path, {"path": "target.plan", "backend": "tensorrt", "precision": "fp32", "layers": 2},
                    SHAPES["tiny"])
