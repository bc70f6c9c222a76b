"""`export convert-head` on a tiny head saved in the EAGLE-3 checkpoint layout (config.json + safetensors): the
converted head computes what EAGLE-3's layer computes (an independent re-implementation here), drafts losslessly
with `--draft eagle`, its ONNX step equals it, and pickles are refused."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.spec.draft_head import load_head
from spork_trt.spec.eagle import EagleDrafter, lookup
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import UserError
from spork_trt.learn.convert_head import convert
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import onnx_head_step_matching, tiny_config

C, H, HKV, D, F, V, N = 64, 4, 2, 16, 128, 48, 40


@pytest.fixture(scope="module")
def target():
    return random_checkpoint(tiny_config(vocab_size=V, n_layers=3), seed=11, scale=8.0).model


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """A random head in the EAGLE-3 repository's layout; its draft vocabulary: 40 of the 48 target ids."""
    d = tmp_path_factory.mktemp("eagle3")
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g) / math.sqrt(shape[-1])  # noqa: E731
    ids = torch.randperm(V, generator=g)[:N].sort().values
    t = {"fc.weight": r(C, 3 * C), "midlayer.self_attn.q_proj.weight": r(H * D, 2 * C),
         "midlayer.self_attn.k_proj.weight": r(HKV * D, 2 * C), "midlayer.self_attn.v_proj.weight": r(HKV * D, 2 * C),
         "midlayer.self_attn.o_proj.weight": r(C, H * D), "midlayer.mlp.gate_proj.weight": r(F, C),
         "midlayer.mlp.up_proj.weight": r(F, C), "midlayer.mlp.down_proj.weight": r(C, F),
         "midlayer.input_layernorm.weight": 1 + 0.1 * r(C), "midlayer.hidden_norm.weight": 1 + 0.1 * r(C),
         "midlayer.post_attention_layernorm.weight": 1 + 0.1 * r(C), "norm.weight": 1 + 0.1 * r(C),
         "lm_head.weight": r(N, C) * 8, "d2t": ids - torch.arange(N), "t2d": torch.zeros(V, dtype=torch.bool),
         "embed_tokens.weight": r(V, C)}
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": C, "num_attention_heads": H,
        "num_key_value_heads": HKV, "head_dim": D, "intermediate_size": F, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": V, "draft_vocab_size": N}))
    return d, t


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference(t, emb, feats):
    """EAGLE-3's draft step written out: g = fc(features); attention over [rms(emb); rms(g)] with RoPE and grouped
    KV heads, causal; g is the residual; MLP; logits over the draft vocabulary, ids mapped by d2t offsets.
    emb [T, C], feats [T, 3C] -> (h [T, C], token ids [T])."""
    n = emb.shape[0]
    gfeat = feats @ t["fc.weight"].T
    x = torch.cat([rms(emb, t["midlayer.input_layernorm.weight"]), rms(gfeat, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, H, D).transpose(0, 1)  # [H, T, D]
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, HKV, D).transpose(0, 1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, HKV, D).transpose(0, 1)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(n).float()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda y: y * cos + torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(H // HKV, 0), v.repeat_interleave(H // HKV, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(D) + torch.full((n, n), float("-inf")).triu(1)
    a = (s.softmax(-1) @ v).transpose(0, 1).reshape(n, H * D) @ t["midlayer.self_attn.o_proj.weight"].T
    h = gfeat + a
    m = rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    logits = rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
    best = logits.argmax(-1)
    return h, best + t["d2t"][best]


def test_converted_head_computes_eagle3(eagle3, tmp_path):
    src, t = eagle3
    head, meta = load_head(convert(src, tmp_path, (1, 2, 3)))
    assert head.hc.layout == "eagle3" and head.hc.vocab == N and meta["format"] == "eagle3"
    g = torch.Generator().manual_seed(5)
    emb, feats = torch.randn(7, C, generator=g), torch.randn(7, 3 * C, generator=g)
    with torch.no_grad():
        h, logits = head(emb[None], head.fuse(feats)[None], torch.arange(7)[None], causal_mask(0, 7))
    fp16 = {k: v.half().float() if v.is_floating_point() else v for k, v in t.items()}  # the head is saved in fp16
    want_h, want_ids = reference(fp16, emb, feats)
    assert torch.allclose(h[0], want_h, atol=1e-4)
    assert torch.equal(head.d2t[logits[0].argmax(-1)], want_ids)


def test_converted_head_drafts_losslessly(eagle3, target, tmp_path):
    head, _ = load_head(convert(eagle3[0], tmp_path, (1, 2, 3)))
    engine = TorchEngine(target, taps=head.hc.taps)
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5)
    for prompt in ([1, 2, 3, 4, 5, 6], [40, 3, 3, 17]):
        d = EagleDrafter(head, lookup(target.embed.weight.detach()), GenerateConfig().sampling, torch.Generator())
        got = generate(engine, prompt, GenerateConfig(max_new_tokens=30), frozenset(), drafter=d, spec=spec)
        assert got.token_ids == generate(TorchEngine(target), prompt, GenerateConfig(max_new_tokens=30),
                                         frozenset()).token_ids
        assert got.stats.draft_tokens > 0


def test_converted_heads_onnx_step_equals_the_torch_head(eagle3, target, tmp_path):
    """`export build` writes head.onnx for a converted head too: the same outputs and KV rows as the torch head,
    and the drafter with it drafts the same trees (spork == plain)."""
    head, _ = load_head(convert(eagle3[0], tmp_path, (1, 2, 3)))
    step = onnx_head_step_matching(head, tmp_path)
    engine = TorchEngine(target, taps=head.hc.taps)
    spec = SpecConfig(draft="eagle", tree_width=2, tree_depth=3, tree_budget=5, adaptive=False)
    drafts = {}
    for name, s in (("torch", None), ("onnx", step)):
        d = EagleDrafter(head, lookup(target.embed.weight.detach()), GenerateConfig().sampling, torch.Generator())
        d.step = s
        got = generate(engine, [40, 3, 3, 17], GenerateConfig(max_new_tokens=30), frozenset(), drafter=d, spec=spec)
        assert got.token_ids == generate(TorchEngine(target), [40, 3, 3, 17], GenerateConfig(max_new_tokens=30),
                                         frozenset()).token_ids
        drafts[name] = (got.stats.draft_tokens, got.stats.accepted_tokens)
    assert drafts["onnx"] == drafts["torch"] and drafts["onnx"][0] > 0


def test_convert_refuses_pickles_and_wrong_taps(eagle3, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="pickles, which are never loaded"):
        convert(tmp_path / "src", tmp_path / "out", (1, 2, 3))
    with pytest.raises(UserError, match="its fc reads 3 tapped layers"):
        convert(eagle3[0], tmp_path / "out", (1, 2))
