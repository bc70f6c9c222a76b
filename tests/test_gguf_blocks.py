"""An int4 target that keeps a GGUF checkpoint's own blocks (export/gguf_blocks.py), on tiny Llama checkpoints
written as llama.cpp writes them (Q4_0, Q4_1, Q8_0; Q/K rows permuted): every weight MatMul is replaced by
MatMulNBits over the very blocks (their dequantized values equal the fp32 graph's weights bit for bit, or the
MatMul is not replaced), the graph runs on ONNX Runtime close to fp32, closer than requantizing does."""
from __future__ import annotations

import gguf
import numpy as np
import onnx
import pytest
import torch

from spork_trt.engines import chain_input
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.export.gguf_blocks import int4_from_blocks
from spork_trt.checkpoint.gguf_blocks import decode
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.export.quantize import quantize
from spork_trt.checkpoint.weights import load_checkpoint
from tests.test_weights import hf_tiny, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_decoded_blocks_dequantize_as_gguf_does(kind):
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(Q, kind))
    assert np.array_equal(decode(kind, raw).dequantized(), gguf.quants.dequantize(raw, getattr(Q, kind)))


def logits(path, cfg, ids) -> torch.Tensor:
    e = OnnxEngine(path, cfg, min_rows=2)
    return e.forward_batch([chain_input(e.make_pool(1, 128).caches[0], ids)])[0]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_int4_keeps_the_checkpoint_blocks(tmp_path, qtype):
    hf, _ = hf_tiny(tmp_path, "default", tied=False)
    write_gguf(tmp_path / "tiny.gguf", hf, getattr(Q, qtype))
    ck = load_checkpoint(tmp_path / "tiny.gguf")
    fp32 = export_onnx(ck.model, tmp_path / "fp32.onnx")
    kept = int4_from_blocks(fp32, tmp_path / "kept.onnx", ck)
    ops = [n.op_type for n in onnx.load(str(kept), load_external_data=False).graph.node]
    before = [n.op_type for n in onnx.load(str(fp32), load_external_data=False).graph.node]
    weight_matmuls = 4 * ck.cfg.n_layers + 1  # wqkv, wo, gate_up, down per layer; the LM head
    assert ops.count("MatMulNBits") == weight_matmuls
    offsets = weight_matmuls if qtype == "Q4_1" else 0  # Q4_1's m: x's block sums @ M', one per weight
    assert ops.count("MatMul") == before.count("MatMul") - weight_matmuls + offsets
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = logits(fp32, ck.cfg, ids)
    requant = logits(quantize("int4", fp32, tmp_path / "requant.onnx"), ck.cfg, ids)
    ours = logits(kept, ck.cfg, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # Q4_1's offsets are lost by symmetric requantization; Q4_0 is what it computes anyway (the same blocks)
    assert (ours - ref).abs().mean() <= (0.5 if qtype == "Q4_1" else 1.0) * (requant - ref).abs().mean()
