"""ONNX export and the ONNX Runtime engine on tiny seeded random models: the graph follows io_spec, ORT matches the
torch engine, the engine interface invariants hold, and spork on ORT engines is lossless."""
from __future__ import annotations

import onnx
import pytest
import torch

from spork_trt import io_spec
from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.spec.drafters import ModelDrafter
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.export.onnx_graph import attention_of, export_onnx
from spork_trt.export.quantize import quantize_nbits
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    model = random_checkpoint(tiny_config(vocab_size=64, n_layers=3, dim=64), seed=21, scale=8.0).model
    target = export_onnx(model, d / "target.onnx")
    early = export_onnx(model, d / "early.onnx", n_layers=1)
    int8 = quantize_nbits(target, d / "draft_int8.onnx", bits=8)
    return model, target, early, int8


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    """The same model's graphs with io_spec.PLAIN attention (standard ops: TensorRT's, ORT GPU providers')."""
    d = tmp_path_factory.mktemp("onnx_plain")
    model = tiny[0]
    return (export_onnx(model, d / "target.onnx", attention=io_spec.PLAIN),
            export_onnx(model, d / "early.onnx", n_layers=1, attention=io_spec.PLAIN))


@pytest.mark.parametrize("attention", io_spec.ATTENTIONS)
def test_graph_follows_io_spec(tiny, plain, attention):
    model = tiny[0]
    target, early = tiny[1:3] if attention == io_spec.GQA else plain
    for path, n in ((target, 3), (early, 1)):
        assert attention_of(path) == attention
        g = onnx.load(str(path), load_external_data=False).graph
        want_in, want_out = io_spec.inputs(model.cfg, n, attention), io_spec.outputs(model.cfg, n, (), attention)
        assert [i.name for i in g.input] == [s.name for s in want_in]
        assert [o.name for o in g.output] == [s.name for s in want_out]
        for vi, spec in zip(list(g.input) + list(g.output), want_in + want_out):
            dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            assert dims == list(spec.dims), (vi.name, dims, spec.dims)


def test_the_manifest_backend_chooses_the_engine_not_the_file_name(tiny, tmp_path):
    """load_engine goes by the entry's backend (engines.LOADERS), never by the file's suffix: an ONNX graph named
    *.plan runs on ONNX Runtime, the same as the torch engine; entries of builds made before entries recorded their
    backend keep theirs; an unknown backend is refused naming the fix."""
    import shutil

    from spork_trt.engines import load_engine
    from spork_trt.errors import UserError
    from spork_trt.checkpoint.manifest import engine_backend

    model, target = tiny[:2]
    for p in target.parent.glob(target.name + "*"):  # the graph and its external data, which it names
        shutil.copyfile(p, tmp_path / p.name)
    (tmp_path / target.name).rename(tmp_path / "target.plan")
    eng = load_engine(tmp_path, {"path": "target.plan", "backend": "onnx", "precision": "fp32", "layers": 3},
                      model.cfg)
    assert isinstance(eng, OnnxEngine)
    ids = torch.tensor([[1, 2, 3]])
    got = eng.forward(eng.make_cache(16), ids, torch.arange(3)[None], causal_mask(0, 3))
    ref = TorchEngine(model)
    torch.testing.assert_close(got, ref.forward(ref.make_cache(16), ids, torch.arange(3)[None], causal_mask(0, 3)),
                               atol=1e-4, rtol=1e-4)
    assert engine_backend({"path": "target.plan", "precision": "fp32", "profile": {}}) == "tensorrt"
    assert engine_backend({"path": "draft_int8.onnx", "precision": "int8"}) == "onnx"
    with pytest.raises(UserError, match="backend 'vulkan'.*rebuild"):
        load_engine(tmp_path, {"path": "target.plan", "backend": "vulkan", "layers": 3}, model.cfg)


def test_a_graph_exported_by_an_older_version_is_refused(tiny):
    """A lean-3 GroupQueryAttention graph (tokens padded, no padded_rows / packed_rows inputs) is refused in one
    line naming the fix, not run with inputs it does not have."""
    from types import SimpleNamespace

    from spork_trt.errors import UserError

    model, target = tiny[:2]
    old = [s.name for s in io_spec.inputs(model.cfg, 3, io_spec.GQA) if s.name not in ("padded_rows", "packed_rows")]
    session = SimpleNamespace(get_inputs=lambda: [SimpleNamespace(name=n) for n in old], get_outputs=lambda: [])
    with pytest.raises(UserError, match="older version.*python -m export build"):
        OnnxEngine(target, model.cfg, session=session)
    assert OnnxEngine(target, model.cfg).padded_batches is False  # the packed graph costs a batch its total tokens


@pytest.mark.parametrize("attention", io_spec.ATTENTIONS)
def test_lean_graph_has_no_shape_arithmetic_and_fused_projections(tiny, plain, attention):
    from spork_trt.export.lean import rotate_half_matrix
    from spork_trt.checkpoint.transformer import rotate_half

    model = tiny[0]
    target = tiny[1] if attention == io_spec.GQA else plain[0]
    x = torch.randn(3, 5, model.cfg.head_dim)
    assert torch.equal(x @ rotate_half_matrix(model.cfg.head_dim), rotate_half(x))  # exact, not close
    nodes = onnx.load(str(target), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    assert not [n.name for n in nodes if n.op_type == "Shape" and "layers" in n.name]  # constant-shape reshapes
    weight_matmuls = 3 * 4 + 1  # per layer: qkv, wo, gate_up, down; plus the LM head
    if attention == io_spec.GQA:  # per layer: rotary; the attention core is one op
        assert ops.count("MatMul") == weight_matmuls + 3 and ops.count("GroupQueryAttention") == 3
    else:  # per layer: rotary, scores, values
        assert ops.count("MatMul") == weight_matmuls + 3 * 3 and "GroupQueryAttention" not in ops


def test_gqa_torch_semantics_equal_the_op(tiny):
    """lean.GroupQueryAttention's torch forward (what the exporter traces, and the op's documented semantics) gives
    what ONNX Runtime's op gives on a ragged batch of trees with padding rows: outputs at real rows, rows appended
    at each sequence's own context, nothing else of the buffer touched."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from spork_trt.export.lean import GQA_SLOTS, GroupQueryAttention
    from spork_trt.checkpoint.transformer import mask_bias

    h, hkv, d, m = 4, 2, 8, 12
    ctx, n = [5, 0, 7], [3, 2, 1]
    b, t = len(ctx), max(n)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, t, x * d, generator=gen) for x in (h, hkv, hkv))
    past_k, past_v = (torch.randn(b, hkv, m, d, generator=gen) for _ in range(2))
    width = max(c + j for c, j in zip(ctx, n))
    mask = torch.zeros(b, t, width, dtype=torch.bool)
    for i, (c, j) in enumerate(zip(ctx, n)):
        mask[i, :j, :c] = True
        mask[i, :j, c:c + j] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[:j, :j]
        mask[i, j:, 0] = True
    bias = mask_bias(mask)[:, None]  # [B, 1, T, S]
    qs = torch.tensor(n, dtype=torch.int32)
    sk = torch.tensor([c + j - 1 for c, j in zip(ctx, n)], dtype=torch.int32)
    total = torch.tensor(width, dtype=torch.int32)
    out, pk, pv = GroupQueryAttention.apply(q, k, v, past_k, past_v, qs, sk, total, bias, h, hkv)

    names = ["q", "k", "v", "past_k", "past_v", "sk", "total", "bias", "qs"]
    slots = [""] * (GQA_SLOTS[-1] + 1)
    for slot, name in zip(GQA_SLOTS, names):
        slots[slot] = name
    node = helper.make_node("GroupQueryAttention", slots, ["out", "pk", "pv"], domain="com.microsoft",
                            num_heads=h, kv_num_heads=hkv, causal=1)
    arrays = dict(zip(names, (q, k, v, past_k, past_v, sk, total, bias, qs)))
    vi = helper.make_tensor_value_info
    typ = {torch.float32: TensorProto.FLOAT, torch.int32: TensorProto.INT32}
    graph = helper.make_graph([node], "gqa", [vi(nm, typ[a.dtype], list(a.shape)) for nm, a in arrays.items()],
                              [vi("out", TensorProto.FLOAT, None), vi("pk", TensorProto.FLOAT, None),
                               vi("pv", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {nm: a.numpy() for nm, a in arrays.items()})
    for i, (c, j) in enumerate(zip(ctx, n)):
        assert np.abs(got[0][i, :j] - out[i, :j].numpy()).max() < 1e-5
        for ref, o in ((pk, got[1]), (pv, got[2])):
            assert np.abs(o[i, :, :c + j] - ref[i, :, :c + j].numpy()).max() < 1e-6  # context and new rows
    assert torch.equal(pk[:, :, :5][0], past_k[0, :, :5]) and not torch.equal(pk[0, :, 5:8], past_k[0, :, 5:8])


@pytest.mark.parametrize("make", ["torch", "onnx", "onnx-plain"])
def test_engine_interface_invariants(tiny, plain, make):
    model, target, _, _ = tiny
    engines = {"torch": lambda: TorchEngine(model), "onnx": lambda: OnnxEngine(target, model.cfg),
               "onnx-plain": lambda: OnnxEngine(plain[0], model.cfg)}
    engine = engines[make]()
    ids = [3, 9, 27, 17, 51, 25, 11]
    with torch.no_grad():
        full = model(torch.tensor([ids + [5, 6]]), torch.arange(9)[None], causal_mask(0, 9)).logits[0]
    c = engine.make_cache(32)
    out = engine.forward(c, torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7))[0]
    c.commit()
    assert (out - full[:7]).abs().max() < 1e-4
    # two sibling nodes (5 and 40, both at position 7); keeping node 0 equals having decoded 5 alone
    engine.forward(c, torch.tensor([[5, 40]]), torch.tensor([[7, 7]]), torch.tensor([[[True] * 7 + [True, False],
                                                                                       [True] * 7 + [False, True]]]))
    c.commit([0])
    out = engine.forward(c, torch.tensor([[6]]), torch.tensor([[8]]), causal_mask(8, 1))[0]
    assert (out - full[8:]).abs().max() < 1e-4 and c.length == 8
    c.truncate(7)
    out = engine.forward(c, torch.tensor([[5]]), torch.tensor([[7]]), causal_mask(7, 1))[0]
    assert (out - full[7:8]).abs().max() < 1e-4
    c.truncate(0)  # logits at asked-for rows only: the same values, the same cache rows
    out = engine.forward(c, torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7), rows=[2, 6])[0]
    assert out.shape == (2, model.cfg.vocab_size) and (out - full[[2, 6]]).abs().max() < 1e-4
    c.commit()
    assert engine.forward(c, torch.tensor([[5]]), torch.tensor([[7]]), causal_mask(7, 1), rows=[])[0].shape[0] == 0
    c.commit()
    out = engine.forward(c, torch.tensor([[6]]), torch.tensor([[8]]), causal_mask(8, 1))[0]
    assert (out - full[8:]).abs().max() < 1e-4
    if make != "torch":  # another cache (new buffers): the rows land there, not in the buffers bound before
        new = engine.make_cache(64)
        engine.forward(new, torch.tensor([ids]), torch.arange(7)[None], causal_mask(0, 7), rows=[6])
        new.commit()
        assert new.k is not c.k and new.length == 7 and new.k.any()
        rows = (slice(None), 0, slice(None), slice(0, 7)) if engine.gqa else (slice(None), 0, slice(0, 7))
        assert abs(new.k[rows] - c.k[rows]).max() < 1e-5


@pytest.mark.parametrize("draft", ["int8", "early", "early-plain"])
@pytest.mark.parametrize("width,depth,share", [(1, 4, True), (3, 3, True), (3, 3, False)])
def test_spork_on_onnx_engines_equals_plain(tiny, plain, draft, width, depth, share):
    model, target, early, int8 = tiny
    cfg = GenerateConfig(max_new_tokens=40, sampling=SamplingConfig())
    want = generate(TorchEngine(model), [1, 2, 3, 4], cfg, frozenset()).token_ids
    if draft == "early-plain":
        target, early = plain
    engine = OnnxEngine(early, model.cfg, n_layers=1) if draft.startswith("early") else OnnxEngine(int8, model.cfg)
    drafter = ModelDrafter(engine, SamplingConfig(), torch.Generator(), share_prompt=share)
    spec = SpecConfig(tree_width=width, tree_depth=depth, tree_budget=width * depth)
    got = generate(OnnxEngine(target, model.cfg), [1, 2, 3, 4], cfg, frozenset(), drafter=drafter, spec=spec)
    assert got.token_ids == want
