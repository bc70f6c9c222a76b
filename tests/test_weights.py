"""Weight loading: HF directories and GGUF files map onto our model exactly; bad files fail clearly."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spork_trt.errors import UserError
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.weights import HEAD, LAYER_LAYOUT, LAYOUT, load_checkpoint, permute_rope, unpermute_rope
from spork_trt.config import LLAMA

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def hf_tiny(tmp_path, rope="default", tied=True, seed=0):
    torch.manual_seed(seed)
    c = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_parameters=ROPES[rope],
                    tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(c).eval()
    with torch.no_grad():  # larger weights than the default init, so the logits are not all alike
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    d = tmp_path / f"hf-{rope}-{tied}"
    m.save_pretrained(d)
    return m, d


def our_logits(model, ids):
    n = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(n)[None], causal_mask(0, n)).logits


@pytest.mark.parametrize("rope,tied", [("default", True), ("linear", False), ("llama3", True)])
def test_hf_directory_matches_transformers(tmp_path, rope, tied):
    hf, d = hf_tiny(tmp_path, rope, tied)
    ck = load_checkpoint(d)
    assert ck.kind == "hf" and ck.cfg.tie_embeddings == tied
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    assert (our_logits(ck.model, ids) - want).abs().max() < 1e-4


def write_gguf(path, hf_model, qtype=gguf.GGMLQuantizationType.F32, arch="llama"):
    """Write an HF model as llama.cpp would: GGUF names, Q/K rows permuted, 2-D weights in `qtype`."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    names = [(e.hf, e.gguf, e.rope_heads) for e in LAYOUT]
    if not c.tie_word_embeddings:
        names.append((HEAD.hf, HEAD.gguf, None))
    for i in range(c.num_hidden_layers):
        names += [(e.hf.format(i=i), e.gguf.format(i=i), e.rope_heads) for e in LAYER_LAYOUT if e.when(LLAMA)]
    heads = {"q": c.num_attention_heads, "k": c.num_key_value_heads}
    for hf_name, gg_name, rope in names:
        t = sd[hf_name]
        if rope is not None:
            t = permute_rope(t, heads["q" if "q_proj" in hf_name else "k"])
        arr = t.numpy()
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gg_name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gg_name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_rope_permutation_round_trip():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope(permute_rope(w, 4), 4), w)
    assert not torch.equal(permute_rope(w, 4), w)


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_f32_matches_hf(tmp_path, tied):
    hf, _ = hf_tiny(tmp_path, "default", tied)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    ck = load_checkpoint(path)
    assert ck.kind == "gguf" and ck.cfg.tie_embeddings == tied
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
    assert (our_logits(ck.model, ids) - want).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_a_model_bigger_than_the_free_memory_is_refused_before_loading(tmp_path, monkeypatch, fmt):
    """Its fp32 weights against the RAM available (here made 1 KiB): one line naming both, before any weight is
    read (the tensor reads are made to fail: they are never reached)."""
    from spork_trt.checkpoint import resources

    hf, d = hf_tiny(tmp_path, "default", True)
    path = tmp_path / "tiny.gguf"
    if fmt == "gguf":
        write_gguf(path, hf)
    monkeypatch.setattr(resources, "available_bytes", lambda: 1024)
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(UserError, match=r"GiB as fp32 weights, but this machine has 0\.0 GiB of RAM available"):
        load_checkpoint(path if fmt == "gguf" else d)
    monkeypatch.setattr(resources, "available_bytes", lambda: 2**40)
    if fmt == "hf":
        assert load_checkpoint(d).kind == "hf"  # with room, the same directory loads


@pytest.mark.parametrize("qname", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_quant_types_dequantize_to_the_written_values(tmp_path, qname):
    qtype = getattr(gguf.GGMLQuantizationType, qname)
    hf, _ = hf_tiny(tmp_path)
    path = tmp_path / f"tiny-{qname}.gguf"
    write_gguf(path, hf, qtype)
    ck = load_checkpoint(path)
    ref = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype)
    np.testing.assert_array_equal(ck.model.layers[1].mlp.down.weight.detach().numpy(), want)
    tol = {"F16": 1e-3, "BF16": 1e-2}.get(qname, 0.05)
    assert np.abs(want - ref).max() < tol  # a sanity bound on the quantization error itself


def test_gguf_of_other_architecture_is_refused(tmp_path):
    hf, _ = hf_tiny(tmp_path)
    path = tmp_path / "other.gguf"
    write_gguf(path, hf, arch="gpt2")
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(path)


def test_gguf_unsupported_quant_type_is_refused(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    qt = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[qt]
    w.add_tensor("token_embd.weight", np.zeros((4, size), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="IQ2_XXS, which is not supported"):
        load_checkpoint(path)


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, d = hf_tiny(tmp_path)
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in sd.items() if k != name}, d / "model.safetensors")
    with pytest.raises(UserError, match=f"tensor {name} is missing"):
        load_checkpoint(d)
    save_file({**sd, name: sd[name][:, :10].contiguous()}, d / "model.safetensors")
    with pytest.raises(UserError, match=rf"tensor {name} has shape \(160, 10\)"):
        load_checkpoint(d)
    save_file({**sd, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, d / "model.safetensors")
    with pytest.raises(UserError, match="not consumed.*q_norm"):
        load_checkpoint(d)


def test_bad_paths_and_formats(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "model.bin").write_bytes(b"not a model")
    with pytest.raises(UserError, match="unknown model format"):
        load_checkpoint(tmp_path / "model.bin")
    with pytest.raises(UserError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 8}))
    with pytest.raises(UserError, match="no \\*.safetensors weights"):
        load_checkpoint(tmp_path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUFjunk")
    with pytest.raises(UserError, match="not a readable GGUF"):
        load_checkpoint(tmp_path / "junk.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        load_checkpoint(tmp_path)
