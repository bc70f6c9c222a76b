"""Parity with transformers on the real default model (SmolLM2-135M-Instruct, GGUF Q4_1, dequantized to fp32)."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.transformer import causal_mask
from tests.conftest import mt_bench_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_default(default_checkpoint):
    from transformers import LlamaForCausalLM

    p = default_checkpoint.path
    return LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def prompt_ids(tok, n=64):
    ids = tok.encode_prompt(mt_bench_prompts(1)[0])
    return (ids * 4)[:n]


def test_default_config_is_smollm2(default_checkpoint):
    c = default_checkpoint.cfg
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.vocab_size, c.tie_embeddings) == (30, 576, 9, 3, 49152, True)


def test_logits_match_transformers(default_checkpoint, default_tokenizer, hf_default):
    ids = torch.tensor([prompt_ids(default_tokenizer)])
    with torch.no_grad():
        want = hf_default(ids).logits
        got = default_checkpoint.model(ids, torch.arange(64)[None], causal_mask(0, 64)).logits
    assert (got - want).abs().max() <= 1e-3


def test_greedy_64_tokens_match_transformers(default_checkpoint, default_tokenizer, hf_default):
    ids = default_tokenizer.encode_prompt(mt_bench_prompts(2)[1])
    with torch.no_grad():
        out = hf_default.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    want = out[0, len(ids):].tolist()
    eos = frozenset()  # transformers was told to run 64 tokens regardless of EOS; so are we
    got = generate(TorchEngine(default_checkpoint.model), ids, GenerateConfig(max_new_tokens=64), eos)
    assert got.token_ids == want
