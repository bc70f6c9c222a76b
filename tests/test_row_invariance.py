"""A target's row computes the same logits, bit for bit, alone, inside a tree and inside a batch (row_invariance.py):
on a tiny seeded model exported as the default build does (GroupQueryAttention), in fp32 and quantized (MatMulNBits
int8 and int4, int8 activations), with `min_rows` 2, also a one-token sequence packed beside a prompt chunk. Without it a one-row sequence takes
other kernels, and the
quantized graphs turn that into a different argmax (checked here too, so the test can fail)."""
from __future__ import annotations

import pytest
import torch

from spork_trt.engines import chain_input
from spork_trt.engines.cpu import kernels as int4_kernel
from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.export.quantize import quantize
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config

CFG = tiny_config(vocab_size=64, n_layers=3, dim=64)
PROMPT, NEXT = [3, 9, 27, 17, 51, 25, 11, 40], [33, 2, 8, 60]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    fp32 = export_onnx(random_checkpoint(CFG, seed=21, scale=8.0).model, d / "target.onnx")
    return {"fp32": fp32, **{q: quantize(q, fp32, d / f"{q}.onnx") for q in ("int8", "int4")}}


def logits_alone(e: OnnxEngine) -> torch.Tensor:
    """Prefill, then NEXT one token per forward: [4, V]."""
    cache = e.make_pool(1, 64).caches[0]
    e.forward_batch([chain_input(cache, PROMPT)])
    cache.commit()
    rows = []
    for t in NEXT:
        rows.append(e.forward_batch([chain_input(cache, [t])])[0][0])
        cache.commit()
    return torch.stack(rows)


def logits_in_a_tree(e: OnnxEngine) -> torch.Tensor:
    """Prefill, then NEXT as one chain (a tree's path) in one forward: [4, V]."""
    cache = e.make_pool(1, 64).caches[0]
    e.forward_batch([chain_input(cache, PROMPT)])
    cache.commit()
    return e.forward_batch([chain_input(cache, NEXT)])[0]


def logits_in_a_batch(e: OnnxEngine) -> torch.Tensor:
    """Two sequences in one pool stepped together, one token each per forward (plain decoding of a batch), after a
    neighbour with another prompt: the first sequence's [4, V]."""
    pool = e.make_pool(2, 64).caches
    e.forward_batch([chain_input(pool[0], PROMPT), chain_input(pool[1], PROMPT[::-1] + [5, 6])])
    rows, other = [], [7, 12, 19, 44]
    for t, u in zip(NEXT, other):
        for c in pool:
            c.commit()
        rows.append(e.forward_batch([chain_input(pool[0], [t]), chain_input(pool[1], [u])])[0][0])
    return torch.stack(rows)


def logits_beside_a_prompt(e: OnnxEngine) -> torch.Tensor:
    """One token per forward while a neighbour's prompt is prefilled in 3-token chunks in the same forwards (the
    engine core's step with a joining request): the first sequence's [4, V]."""
    pool = e.make_pool(2, 64).caches
    e.forward_batch([chain_input(pool[0], PROMPT)])
    prompt, rows = [7, 12, 19, 44, 3, 5, 9, 1, 2, 6, 8, 10], []
    for k, t in enumerate(NEXT):
        for c in pool:
            c.commit()
        rows.append(e.forward_batch([chain_input(pool[0], [t]), chain_input(pool[1], prompt[3 * k:3 * k + 3], ())])
                    [0][0])
    return torch.stack(rows)


AVX512 = "avx512f" in int4_kernel.cpu_flags()
# Found on a 2-core AVX2-only EPYC (Zen 1, 2026-12-06): ONNX Runtime's MatMulNBits int4 gives a row alone (2 rows)
# other bits than inside a tree there, so the int4 ONNX target is not row-invariant on such a CPU (int8 is). Strict:
# it must still fail there until it is mended (docs/support.md), and pass everywhere else.
INT4_ON_AVX2 = pytest.mark.xfail(not AVX512, strict=True, reason="MatMulNBits int4 is not row-invariant on an "
                                 "AVX2-only CPU (a known gap: docs/support.md)")


@pytest.mark.parametrize("precision", ["fp32", "int8", pytest.param("int4", marks=INT4_ON_AVX2)])
def test_a_row_is_the_same_alone_in_a_tree_and_in_a_batch(graphs, precision):
    e = OnnxEngine(graphs[precision], CFG, min_rows=2)
    alone = logits_alone(e)
    assert torch.equal(alone, logits_in_a_tree(e))
    assert torch.equal(alone, logits_in_a_batch(e))
    assert torch.equal(alone, logits_beside_a_prompt(e))  # a 1-token sequence packed beside a longer one


def test_without_the_dummy_row_a_quantized_row_alone_differs(graphs):
    e = OnnxEngine(graphs["int8"], CFG, min_rows=1)
    assert not torch.equal(logits_alone(e), logits_in_a_tree(e))  # what min_rows=2 removes


def test_a_quantized_target_verifying_chains_is_lossless_alone_and_batched(graphs):
    """spork == plain greedy, token for token, on the int8 target: chains drafted by the fp32 graph (a close draft:
    long accepted runs), one request alone and four batched together."""
    from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
    from spork_trt.loop.request import Submission
    from spork_trt.spec.drafters import ModelDrafter
    from spork_trt.loop.generate import generate, run_many

    target = OnnxEngine(graphs["int8"], CFG, min_rows=2)
    cfg, chain = GenerateConfig(max_new_tokens=40), SpecConfig(draft="self-fp32", tree_width=1, tree_depth=4,
                                                              tree_budget=4)
    prompts = [PROMPT, PROMPT[:3], NEXT + PROMPT, [1, 2, 3, 4, 5]]
    plain = [generate(target, p, cfg, frozenset()).token_ids for p in prompts]

    def drafted(p: list[int]) -> Submission:
        drafter = ModelDrafter(OnnxEngine(graphs["fp32"], CFG), SamplingConfig(), torch.Generator())
        return Submission(p, cfg, frozenset(), chain, drafter)

    alone = [generate(target, p, cfg, frozenset(), drafter=drafted(p).drafter, spec=chain) for p in prompts]
    assert [r.token_ids for r in alone] == plain
    assert sum(r.stats.accepted_tokens for r in alone) > 40  # speculation did happen
    subs = [drafted(p) for p in prompts]
    done = {r.sub: r for r in run_many(target, subs, slots=4, max_len=128)}
    assert [done[s].result().token_ids for s in subs] == plain
