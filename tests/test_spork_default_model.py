"""Keystone on the real default model: spork greedy == plain greedy of the same target, token for token, for every
drafter: 128 new tokens on the build's fp32 ONNX target (the deployment path, 2-3x faster) for 8 MT-bench + 8
HumanEval prompts, 32 on the slower torch reference engine for 4 + 4 of them; and the ONNX target's plain text is the
reference model's for those 32 tokens (every drafter's losslessness is also exercised in full on the tiny models).
Plain decoding of 128 tokens runs on the ONNX target, not on the slower reference engine: the module's time on a 2-core
Zen 4 went from 386 s (+ 35 s of build) to 310 s in all."""
from __future__ import annotations

import pytest

from spork_trt.config import GenerateConfig, SpecConfig
from tests.conftest import humaneval_prompts, mt_bench_prompts

pytestmark = pytest.mark.slow

PROMPTS = mt_bench_prompts(8) + humaneval_prompts(8)
ON_TORCH = (0, 1, 2, 3, 8, 9, 10, 11)  # the prompts the reference engine runs: 4 MT-bench, 4 HumanEval


@pytest.fixture(scope="module")
def prompt_ids(default_runtime):
    return [default_runtime.tokenizer.encode_prompt(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def torch_ids(prompt_ids):
    return [prompt_ids[i] for i in ON_TORCH]


@pytest.fixture(scope="module")
def plain(default_runtime, torch_ids):
    """Plain greedy on the torch reference engine, 32 new tokens, for the ON_TORCH prompts."""
    cfg = GenerateConfig(max_new_tokens=32)
    return [default_runtime.generate(ids, cfg, mode="plain").token_ids for ids in torch_ids]


@pytest.fixture(scope="module")
def onnx_runtime(default_engines):
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_engines(default_engines)  # dtype fp32: the build's ONNX target, whatever this host's default
    assert rt.backend == "onnx", rt.backend
    return rt


@pytest.fixture(scope="module")
def onnx_plain(onnx_runtime, prompt_ids):
    """Plain greedy on the build's fp32 ONNX target, 128 new tokens."""
    cfg = GenerateConfig(max_new_tokens=128)
    return [onnx_runtime.generate(ids, cfg, mode="plain").token_ids for ids in prompt_ids]


def test_the_onnx_target_decodes_the_reference_models_text(plain, onnx_plain):
    assert sum(len(o) for o in onnx_plain) > 16 * 64  # most run the full 128 tokens; a few end at EOS
    assert [onnx_plain[i][:32] for i in ON_TORCH] == plain


@pytest.mark.parametrize("draft,spec,n", [
    ("ngram", SpecConfig(draft="ngram", tree_width=3, tree_depth=6, tree_budget=12), 32),
    ("self-int8", SpecConfig(draft="self-int8", tree_width=2, tree_depth=5, tree_budget=10), 32),
    ("self-int4", SpecConfig(draft="self-int4", tree_width=1, tree_depth=4, tree_budget=4), 32),
    ("early-exit:8", SpecConfig(draft="early-exit:8", tree_width=2, tree_depth=3, tree_budget=6), 32),
])
def test_spork_equals_plain_on_the_default_model(default_runtime, torch_ids, plain, draft, spec, n):
    cfg = GenerateConfig(max_new_tokens=n)
    accepted = 0
    for ids, want in zip(torch_ids, plain):
        got = default_runtime.generate(ids, cfg, mode="spork", spec=spec)
        assert got.token_ids == want[:n], (draft, ids[:8])  # n <= 32: the fixture's length
        accepted += got.stats.accepted_tokens
    assert accepted > 0  # the drafter really proposed and had tokens accepted


@pytest.mark.parametrize("draft,spec", [
    ("self-int8", SpecConfig(draft="self-int8", tree_width=1, tree_depth=5, tree_budget=5)),
    ("ngram", SpecConfig(draft="ngram", tree_width=3, tree_depth=6, tree_budget=12)),
    ("hybrid", SpecConfig.for_draft("hybrid")),
    ("store", SpecConfig.for_draft("store")),  # the datastore built from the shipped corpus
])
def test_spork_on_onnxruntime_equals_its_plain(onnx_runtime, prompt_ids, onnx_plain, draft, spec):
    cfg = GenerateConfig(max_new_tokens=128)
    accepted = 0
    for ids, want in zip(prompt_ids, onnx_plain):
        got = onnx_runtime.generate(ids, cfg, mode="spork", spec=spec)
        assert got.token_ids == want, (draft, ids[:8])
        accepted += got.stats.accepted_tokens
    assert accepted > 0
