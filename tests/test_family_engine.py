"""Every family on the CPU torch engine (engines/cpu/family_forward.py): each family's tiny transformers model
(tests/test_families.py) in bf16 from its safetensors and in int4 from llama.cpp's own Q8_0 GGUF of it (8-bit codes
on spork's kernel): the logits are the fp32 reference's within bf16 rounding, a row is the same bits alone, in a
chain, in a batch and beside a prompt chunk (Gemma 3's and Mistral's windows included: the prompts here cross
them), and spork == plain alone and batched. The real Gemma 3 270M Q4_K_M: tests/test_gemma3_model.py."""
from __future__ import annotations

import pytest
import torch

from spork_trt.engines.cpu import kernels as int4_kernel
from tests.test_families import FAMILIES, checkpoints, converted  # noqa: F401 - checkpoints: a fixture

onednn = pytest.importorskip("spork_trt.engines.cpu.engine")
if not onednn.onednn_bf16_available() or int4_kernel.kernel() != "spork":
    pytest.skip("the family layers run here on oneDNN's bf16 and spork's block kernels", allow_module_level=True)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def q8_files(checkpoints, tmp_path_factory):  # noqa: F811 - the imported fixture
    return converted(checkpoints, tmp_path_factory.mktemp("q8"), "q8_0")


@pytest.fixture(scope="module")
def engines(checkpoints, q8_files):  # noqa: F811
    """(family, dtype) -> (the engine, the fp32 reference model of the same weights)."""
    from spork_trt.checkpoint.weights import load_checkpoint

    out = {}
    for family in FAMILIES:
        hf = load_checkpoint(checkpoints[family][1])
        q8 = load_checkpoint(q8_files[family])
        out[family, "bf16"] = (onednn.cpu_target(hf, "bf16"), hf.model)
        out[family, "int4"] = (onednn.cpu_target(q8, "int4"), q8.model)
    return out


CASES = [(f, d) for f in FAMILIES for d in ("bf16", "int4")]


@pytest.mark.parametrize("family, dtype", CASES)
def test_logits_are_the_references_and_a_row_is_the_same_everywhere(engines, family, dtype):
    from spork_trt.checkpoint.transformer import causal_mask
    from spork_trt.engines import chain_input
    from tests.test_row_invariance import logits_alone, logits_beside_a_prompt, logits_in_a_batch, logits_in_a_tree

    engine, ref = engines[family, dtype]
    # family_forward's layers where the family needs them (Phi-3 is Llama's after the split; llama.cpp writes Mistral
    # as a `llama` GGUF without its window, which llama.cpp runs without one)
    assert (engine.family is not None) == (family in ("qwen2", "qwen3", "gemma3") or (family, dtype) == ("mistral",
                                                                                                        "bf16"))
    ids = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(4)).tolist()  # past the 24 window
    with torch.no_grad():
        want = ref(torch.tensor([ids]), torch.arange(40)[None], causal_mask(0, 40)).logits[0]  # [T, V]
    got = engine.forward_batch([chain_input(engine.make_pool(1, 64).caches[0], ids)])[0]
    # bf16 activations on tiny random models (logits of near ties): measured agreement 0.875-1.0, max error 1.8-8.8%
    # of the largest logit for every family and dtype, Llama's own path included; a missing family step is ~100%
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8, family
    assert (got - want).abs().max() <= 0.15 * want.abs().max(), (family, (got - want).abs().max())
    alone = logits_alone(engine)
    assert torch.equal(alone, logits_in_a_tree(engine)) and torch.equal(alone, logits_in_a_batch(engine))
    assert torch.equal(alone, logits_beside_a_prompt(engine))


@pytest.mark.parametrize("family", FAMILIES)
def test_spork_is_plain_alone_and_batched(checkpoints, q8_files, family, monkeypatch):  # noqa: F811
    """The int4 engine on the Q8_0 GGUF, through the runtime: n-gram trees and a self-int8 drafter's chains, alone,
    and a batch of three through the engine core. (The tokenizer is read from the safetensors folder: transformers
    reads these converter-written GGUF vocabularies only with tiktoken installed; the prompts are token ids.)"""
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.config import GenerateConfig, SpecConfig
    from spork_trt.loop import runtime as runtime_module
    from spork_trt.loop.engine_core import CoreConfig, EngineCore
    from tests.conftest import run_core
    from tests.test_families import prompts

    hf_dir = checkpoints[family][1]
    monkeypatch.setattr(runtime_module, "load_tokenizer", lambda path, kind, eos=(): load_tokenizer(hf_dir, "hf", eos))
    rt = runtime_module.Runtime.load(q8_files[family], "cpu", "int4")
    cfg = GenerateConfig(max_new_tokens=32)
    ps = prompts(3)
    plain = [rt.generate(p, cfg).token_ids for p in ps]
    for draft in ("ngram", "self-int8"):
        assert [rt.generate(p, cfg, "spork", SpecConfig.for_draft(draft)).token_ids for p in ps] == plain, draft
    core = EngineCore(rt.engine, rt.cfg.vocab_size, CoreConfig(slots=3, max_len=256, prefill_tokens=16))
    out = run_core(core, [rt.request(p, cfg, "spork" if i else "plain", SpecConfig.for_draft("ngram"))
                          for i, p in enumerate(ps)])
    assert [out[i].token_ids for i in range(len(ps))] == plain
