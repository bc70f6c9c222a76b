"""The int4 CPU engine on a GGUF checkpoint of mixed block types, as llama.cpp's Q4_K_M / Q5_K_M files mix them
(Q4_K, Q5_K, Q5_0, Q5_1, Q4_0, Q8_0 on their own blocks; Q6_K in bf16): the blocks decode to gguf.quants' own
dequantization bit for bit, each weight runs the path it should, the logits are the fp32 model's within bf16
rounding, a row is the same bits alone, in a chain, in a batch and beside a prompt chunk, and spork == plain.

The checkpoint is random blocks written with gguf's writer (gguf-py cannot quantize to K-quants; llama.cpp's own
quantizer needs `make bench-peers`): every byte of a block is random but its fp16 scales, set to sizes that give
weights of a trained model's scale."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from spork_trt.checkpoint.gguf_blocks import decode
from spork_trt.engines.cpu import kernels as int4_kernel

Q = gguf.GGMLQuantizationType
BF16 = pytest.importorskip("spork_trt.engines.cpu.engine").onednn_bf16_available()
if int4_kernel.kernel() != "spork" or not BF16:
    pytest.skip("the K-quant layouts run on spork's CPU kernels, and Q6_K's bf16 weight on oneDNN's",
                allow_module_level=True)

# fp16 fields of each type's blocks: (byte offset, low, high); the rest of a block's bytes are random codes / scales
FIELDS = {"Q4_0": [(0, 0.004, 0.012)], "Q4_1": [(0, 0.004, 0.012), (2, -0.08, -0.02)],
          "Q5_0": [(0, 0.002, 0.006)], "Q5_1": [(0, 0.002, 0.006), (2, -0.08, -0.02)],
          "Q8_0": [(0, 2e-4, 6e-4)], "Q4_K": [(0, 5e-5, 1.5e-4), (2, 2e-4, 8e-4)],
          "Q5_K": [(0, 2e-5, 8e-5), (2, 2e-4, 8e-4)], "Q6_K": [(208, 1e-5, 3e-5)]}
# (GGUF name) -> type: layer 0 mixes code widths in q/k/v (so they run apart) and fp32 / fp16 scales in gate/up;
# layer 1 fuses q/k/v from two 8-bit types and gate/up from Q4_K
TYPES = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "Q5_0", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "Q5_0",
         "blk.0.ffn_down.weight": "Q4_0", "blk.1.attn_q.weight": "Q5_0", "blk.1.attn_k.weight": "Q5_0",
         "blk.1.attn_v.weight": "Q5_1", "blk.1.attn_output.weight": "Q4_K", "blk.1.ffn_gate.weight": "Q4_K",
         "blk.1.ffn_up.weight": "Q4_K", "blk.1.ffn_down.weight": "Q4_1", "token_embd.weight": "Q8_0"}
DIM, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 256, 2


def random_blocks(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of `kind` with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[getattr(Q, kind)]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at, lo, hi in FIELDS[kind]:
        raw[..., at:at + 2] = rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_to_gguf_dequantization_bit_for_bit(kind):
    raw = random_blocks(kind, 48, 512, np.random.default_rng(len(kind)))
    b = decode(kind, raw)
    assert b.codes.shape == (48, 512) and b.d.shape == (48, 16)
    assert np.array_equal(b.dequantized(), gguf.quants.dequantize(raw, getattr(Q, kind)))
    assert b.codes.max() < 1 << {"Q4": 4, "Q5": 5, "Q8": 8}[kind[:2]]


def shapes() -> dict[str, tuple[int, int]]:
    """GGUF name -> [rows, K] of every matrix."""
    kv = KV_HEADS * DIM // HEADS
    out = {"token_embd.weight": (VOCAB, DIM)}
    for i in range(LAYERS):
        out |= {f"blk.{i}.attn_q.weight": (DIM, DIM), f"blk.{i}.attn_k.weight": (kv, DIM),
                f"blk.{i}.attn_v.weight": (kv, DIM), f"blk.{i}.attn_output.weight": (DIM, DIM),
                f"blk.{i}.ffn_gate.weight": (FFN, DIM), f"blk.{i}.ffn_up.weight": (FFN, DIM),
                f"blk.{i}.ffn_down.weight": (DIM, FFN)}
    return out


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny Llama GGUF of mixed block types (TYPES), with a byte-level vocabulary of VOCAB tokens."""
    from tests.test_hostile_gguf import with_vocab

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("kquant") / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    for name, (rows, k) in shapes().items():
        w.add_tensor(name, random_blocks(TYPES[name], rows, k, rng), raw_dtype=getattr(Q, TYPES[name]))
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")]:
        w.add_tensor(name, rng.uniform(0.8, 1.2, DIM).astype(np.float32))
    with_vocab(VOCAB, None)(w)  # the vocabulary, then the header
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def runtime(mixed_gguf):
    from spork_trt.loop.runtime import Runtime

    return Runtime.load(mixed_gguf, "cpu", "int4")


def test_each_weight_runs_on_its_own_blocks_and_q6_k_in_bf16(runtime):
    from spork_trt.engines.cpu.linears import Int4Linear, PackedLinear, Q8Linear

    model = runtime.engine.model
    a0, a1, m0, m1 = model.layers[0].attn, model.layers[1].attn, model.layers[0].mlp, model.layers[1].mlp
    assert a0.wqkv is None and isinstance(a0.wq, Int4Linear) and isinstance(a0.wv, PackedLinear)  # Q6_K: bf16
    assert a0.wq.scales.dtype == torch.float32 and a0.wq.packed.shape[1] == DIM // 2  # Q4_K: 4-bit, fp32 scales
    assert isinstance(a0.wo, Int4Linear) and a0.wo.packed.shape[1] == DIM and a0.wo.scales.dtype == torch.float16
    assert isinstance(m0.gate_up, Int4Linear) and m0.gate_up.scales.dtype == torch.float32  # Q5_K + Q5_0: 8-bit
    assert isinstance(a1.wqkv, Int4Linear) and a1.wqkv.scales.dtype == torch.float16  # Q5_0 + Q5_1
    assert isinstance(m1.gate_up, Int4Linear) and m1.down.packed.shape[1] == FFN // 2  # Q4_K; Q4_1
    assert isinstance(model.lm_head, Q8Linear)  # the tied Q8_0 embedding
    assert not runtime.engine.weights.native and runtime.engine.row_floor == 2  # a bf16 weight: the row floor
    paths = runtime.engine.weight_paths  # the startup line (`generate`)
    assert paths.startswith("Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K layer weights on their own blocks") and \
        ", Q6_K in bf16 (oneDNN), the Q8_0 LM head on its blocks" in paths, paths


def test_logits_are_the_fp32_models_within_bf16_rounding(mixed_gguf, runtime):
    from spork_trt.checkpoint.transformer import causal_mask
    from spork_trt.checkpoint.weights import load_checkpoint
    from spork_trt.engines import chain_input

    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = load_checkpoint(mixed_gguf).model
    with torch.no_grad():
        want = ref(torch.tensor([ids]), torch.arange(40)[None], causal_mask(0, 40)).logits[0]  # [40, V]
    e = runtime.engine
    got = e.forward_batch([chain_input(e.make_pool(1, 64).caches[0], ids)])[0]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9  # measured: 1.0
    assert (got - want).abs().max() <= 0.1 * want.abs().max()  # measured: 0.048 (bf16 activations, random weights)


def test_a_row_is_the_same_alone_in_a_chain_in_a_batch_and_beside_a_prompt(runtime):
    from tests.test_row_invariance import logits_alone, logits_beside_a_prompt, logits_in_a_batch, logits_in_a_tree

    e = runtime.engine
    alone = logits_alone(e)
    assert torch.equal(alone, logits_in_a_tree(e)) and torch.equal(alone, logits_in_a_batch(e))
    assert torch.equal(alone, logits_beside_a_prompt(e))


def test_spork_is_plain_alone_and_batched(runtime):
    from spork_trt.config import GenerateConfig, SpecConfig
    from spork_trt.loop.engine_core import CoreConfig, EngineCore
    from tests.conftest import run_core

    cfg = GenerateConfig(max_new_tokens=48)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, VOCAB, 12)] * 2 for _ in range(3)]  # repeats: n-gram drafts hit
    plain = [runtime.generate(p, cfg).token_ids for p in prompts]
    for draft in ("ngram", "self-int8"):
        assert [runtime.generate(p, cfg, "spork", SpecConfig.for_draft(draft)).token_ids for p in prompts] == plain
    core = EngineCore(runtime.engine, runtime.cfg.vocab_size, CoreConfig(slots=3, max_len=256, prefill_tokens=16))
    spec = SpecConfig.for_draft("ngram")
    out = run_core(core, [runtime.request(p, cfg, "spork" if i else "plain", spec) for i, p in enumerate(prompts)])
    assert [out[i].token_ids for i in range(len(prompts))] == plain


def test_the_default_target_is_this_engine_with_onednn_and_onnx_without(mixed_gguf, monkeypatch):
    """engines/default_target.py: the file's block types name the int4 engine, Q6_K's bf16 weight asks for oneDNN
    (so an AVX2-only CPU, with spork's kernels alone, runs the ONNX target)."""
    from spork_trt.engines import default_target
    from spork_trt.engines.cpu import engine as onednn_engine

    assert default_target.has_block_weights(mixed_gguf) and not default_target.only_kernel_blocks(mixed_gguf)
    t = default_target.choose("fp32", mixed_gguf)
    assert (t.device, t.dtype) == ("cpu", "int4") and "Q4_K" in t.why and "Q6_K" not in t.why, t.why
    monkeypatch.setattr(onednn_engine, "onednn_bf16_available", lambda: False)
    assert default_target.choose("fp32", mixed_gguf).device == default_target.ONNX
