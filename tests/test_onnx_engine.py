"""ONNX export and the ONNX Runtime engine on tiny seeded random models: the graph follows io_spec, ORT matches the
torch engine, the engine interface invariants hold, and spork on ORT engines is lossless."""
from __future__ import annotations

import onnx
import pytest
import torch

from spork_trt import io_spec
from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.drafters import ModelDrafter
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.export.quantize import quantize_nbits
from spork_trt.generate import generate
from spork_trt.model import causal_mask
from spork_trt.weights import random_checkpoint
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    model = random_checkpoint(tiny_config(vocab_size=64, n_layers=3, dim=64), seed=21, scale=8.0).model
    target = export_onnx(model, d / "target.onnx")
    early = export_onnx(model, d / "early.onnx", n_layers=1)
    int8 = quantize_nbits(target, d / "draft_int8.onnx", bits=8)
    return model, target, early, int8


def test_graph_follows_io_spec(tiny):
    model, target, early, _ = tiny
    for path, n in ((target, 3), (early, 1)):
        g = onnx.load(str(path), load_external_data=False).graph
        want_in, want_out = io_spec.inputs(model.cfg, n), io_spec.outputs(model.cfg, n)
        assert [i.name for i in g.input] == [s.name for s in want_in]
        assert [o.name for o in g.output] == [s.name for s in want_out]
        for vi, spec in zip(list(g.input) + list(g.output), want_in + want_out):
            dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            assert dims == list(spec.dims), (vi.name, dims, spec.dims)


def test_lean_graph_has_no_shape_arithmetic_and_fused_projections(tiny):
    from spork_trt.export.lean import rotate_half_matrix
    from spork_trt.model import rotate_half

    model, target, _, _ = tiny
    x = torch.randn(3, 5, model.cfg.head_dim)
    assert torch.equal(x @ rotate_half_matrix(model.cfg.head_dim), rotate_half(x))  # exact, not close
    nodes = onnx.load(str(target), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    assert not [n.name for n in nodes if n.op_type == "Shape" and "layers" in n.name]  # constant-shape reshapes
    weight_matmuls = 3 * 4 + 1  # per layer: qkv, wo, gate_up, down; plus the LM head
    assert ops.count("MatMul") == weight_matmuls + 3 * 3  # + per layer: rotary, scores, values


@pytest.mark.parametrize("make", ["torch", "onnx"])
def test_engine_interface_invariants(tiny, make):
    model, target, _, _ = tiny
    engine = TorchEngine(model) if make == "torch" else OnnxEngine(target, model.cfg)
    ids = [3, 9, 27, 17, 51, 25, 11]
    with torch.no_grad():
        full = model(torch.tensor([ids + [5, 6]]), torch.arange(9)[None], causal_mask(0, 9)).logits[0]
    engine.reset(32)
    out = engine.forward(torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7))[0]
    engine.commit()
    assert (out - full[:7]).abs().max() < 1e-4
    # two sibling nodes (5 and 40, both at position 7); keeping node 0 equals having decoded 5 alone
    engine.forward(torch.tensor([[5, 40]]), torch.tensor([[7, 7]]), torch.tensor([[[True] * 7 + [True, False],
                                                                                    [True] * 7 + [False, True]]]))
    engine.commit([0])
    out = engine.forward(torch.tensor([[6]]), torch.tensor([[8]]), causal_mask(8, 1))[0]
    assert (out - full[8:]).abs().max() < 1e-4 and engine.length == 8
    engine.truncate(7)
    out = engine.forward(torch.tensor([[5]]), torch.tensor([[7]]), causal_mask(7, 1))[0]
    assert (out - full[7:8]).abs().max() < 1e-4
    engine.truncate(0)  # logits at asked-for rows only: the same values, the same cache rows
    out = engine.forward(torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7), rows=[2, 6])[0]
    assert out.shape == (2, model.cfg.vocab_size) and (out - full[[2, 6]]).abs().max() < 1e-4
    engine.commit()
    assert engine.forward(torch.tensor([[5]]), torch.tensor([[7]]), causal_mask(7, 1), rows=[])[0].shape[0] == 0
    engine.commit()
    out = engine.forward(torch.tensor([[6]]), torch.tensor([[8]]), causal_mask(8, 1))[0]
    assert (out - full[8:]).abs().max() < 1e-4


@pytest.mark.parametrize("draft", ["int8", "early"])
@pytest.mark.parametrize("width,depth,share", [(1, 4, True), (3, 3, True), (3, 3, False)])
def test_spork_on_onnx_engines_equals_plain(tiny, draft, width, depth, share):
    model, target, early, int8 = tiny
    cfg = GenerateConfig(max_new_tokens=40, sampling=SamplingConfig())
    want = generate(TorchEngine(model), [1, 2, 3, 4], cfg, frozenset()).token_ids
    engine = OnnxEngine(early, model.cfg, n_layers=1) if draft == "early" else OnnxEngine(int8, model.cfg)
    drafter = ModelDrafter(engine, SamplingConfig(), torch.Generator(), share_prompt=share)
    spec = SpecConfig(tree_width=width, tree_depth=depth, tree_budget=width * depth)
    got = generate(OnnxEngine(target, model.cfg), [1, 2, 3, 4], cfg, frozenset(), drafter=drafter, spec=spec)
    assert got.token_ids == want
