"""TensorRT plans on a GPU host (skipped elsewhere: needs the `tensorrt` package and a CUDA device): a tiny seeded
model's plan matches ONNX Runtime through prefill, a tree step, a partial commit and a rollback, and spork on a
TensorRT target stays identical to plain greedy."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.spec.drafters import ModelDrafter
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt import io_spec
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available(),
                                reason="needs the tensorrt package and a CUDA device")
CFG = tiny_config(vocab_size=64, n_layers=3, dim=64, max_seq_len=128)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from spork_trt.export.tensorrt import TrtBuildConfig, build_plan

    d = tmp_path_factory.mktemp("trt")
    model = random_checkpoint(CFG, seed=21, scale=8.0).model
    target = export_onnx(model, d / "target.onnx", attention=io_spec.PLAIN)  # a plan has no com.microsoft op
    plan = build_plan(target, d / "target.plan", TrtBuildConfig(max_new_tokens=32), CFG, CFG.n_layers)
    return model, target, plan


def steps(engine) -> list[torch.Tensor]:
    """prefill 7 (odd: the unaligned-row path for these tiny rows), a 2-node tree, keep node 1 (the KV gather),
    roll back one."""
    ids = [3, 9, 27, 17, 51, 25, 11]
    c = engine.make_cache(32)
    out = [engine.forward(c, torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7))[0]]
    c.commit()
    tree = torch.tensor([[[True] * 7 + [True, False], [True] * 7 + [False, True]]])
    out.append(engine.forward(c, torch.tensor([[5, 40]]), torch.tensor([[7, 7]]), tree)[0])
    c.commit([1])
    out.append(engine.forward(c, torch.tensor([[6]]), torch.tensor([[8]]), causal_mask(8, 1))[0])
    c.commit()
    c.truncate(8)
    out.append(engine.forward(c, torch.tensor([[2]]), torch.tensor([[8]]), causal_mask(8, 1))[0])
    return out


def test_plan_matches_onnxruntime(plans):
    from spork_trt.engines.trt_engine import TrtEngine

    model, target, plan = plans
    for got, want in zip(steps(TrtEngine(plan, CFG)), steps(OnnxEngine(target, CFG))):
        assert (got - want).abs().max() <= 1e-3


def test_spork_on_a_tensorrt_target_equals_plain(plans):
    from spork_trt.engines.trt_engine import TrtEngine

    model, target, plan = plans
    cfg = GenerateConfig(max_new_tokens=40, sampling=SamplingConfig())
    want = generate(TorchEngine(model), [1, 2, 3, 4], cfg, frozenset()).token_ids
    drafter = ModelDrafter(OnnxEngine(target, CFG), SamplingConfig(), torch.Generator())
    got = generate(TrtEngine(plan, CFG), [1, 2, 3, 4], cfg, frozenset(), drafter=drafter,
                   spec=SpecConfig(tree_width=2, tree_depth=3, tree_budget=6))
    assert got.token_ids == want
