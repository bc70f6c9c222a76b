"""The CPU torch engine (engines/cpu/engine.py) on the default model, in bf16 and in int4 (the checkpoint's own
Q4_1 blocks): a chain token's logits are the same, bit for bit, computed alone, inside a chain, inside a batch and
beside a neighbour's prompt chunk; in bf16 without its row floor they are not (so the test can fail); the int4
weights are the checkpoint's; plain and spork decoding through the runtime give the same tokens, alone and batched
through the engine core."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.engines import SeqInput, chain_input
from spork_trt.engines.cpu import kernels as int4_kernel
from spork_trt.engines.cpu.linears import Int4Linear, PackedLinear, Q8Linear
from spork_trt.errors import UserError
from spork_trt.checkpoint.gguf_blocks import blocks_by_parameter
from spork_trt.loop.runtime import Runtime
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import run_core, tiny_config
from tests.test_row_invariance import logits_alone, logits_beside_a_prompt, logits_in_a_batch, logits_in_a_tree

onednn = pytest.importorskip("spork_trt.engines.cpu.engine")
BF16 = onednn.onednn_bf16_available()  # oneDNN's bf16 kernels (AVX512-BF16 or AMX)
INT4 = BF16 or int4_kernel.kernel() == "spork"  # the default model's blocks and head on spork's kernels (AVX2 too)
if not INT4:
    pytest.skip("this CPU has neither oneDNN bf16 kernels nor spork's CPU kernels", allow_module_level=True)
DTYPES = [pytest.param("bf16", marks=pytest.mark.skipif(not BF16, reason="no oneDNN bf16 kernels on this CPU")),
          "int4"]

PROMPTS = ["Write a short poem about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.fixture(scope="module")
def engines(default_checkpoint):
    return {dtype: onednn.cpu_target(default_checkpoint, dtype) for dtype in ("bf16", "int4")[not BF16:]}


@pytest.fixture(scope="module")
def engine(engines):
    if not BF16:
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    return engines["bf16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chain_token_is_the_same_alone_in_a_chain_in_a_batch_and_beside_a_prompt(engines, dtype):
    engine = engines[dtype]
    assert engine.row_floor == (1 if dtype == "int4" else onednn.ROW_FLOOR)  # int4: one row runs alone
    alone = logits_alone(engine)
    assert torch.equal(alone, logits_in_a_tree(engine))  # NEXT as one chain: a tree's path
    assert torch.equal(alone, logits_in_a_batch(engine))
    assert torch.equal(alone, logits_beside_a_prompt(engine))


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_spork_attend_a_trees_rows_compute_their_chains_bits(engines, dtype):
    """A tree (root a; children b and c; d under c) verified in one forward: each row's logits equal, bit for bit,
    those of the same tokens as a chain (a c d, a b), though its ancestors sit at other columns."""
    engine = engines[dtype]
    if not engine.weights.fused:
        pytest.skip("spork's CPU kernels are not built here (trees are exact by construction on spork::attend)")
    prompt, (a, b, c, d) = [1, 1, 2, 3, 5, 8, 13, 21, 34], (55, 89, 144, 233)

    def run(tokens, parents):
        cache = engine.make_pool(1, 64).caches[0]
        engine.forward_batch([chain_input(cache, prompt)])
        cache.commit()
        n, base = len(tokens), len(prompt)
        anc = torch.eye(n, dtype=torch.bool)
        depth = [0] * n
        for i, p in enumerate(parents):
            if p >= 0:
                anc[i] |= anc[p]
                depth[i] = depth[p] + 1
        return engine.forward_batch([SeqInput(cache, tuple(tokens), tuple(base + x for x in depth), anc)])[0]

    tree = run([a, b, c, d], [-1, 0, 0, 2])
    acd, ab = run([a, c, d], [-1, 0, 1]), run([a, b], [-1, 0])
    assert torch.equal(tree[[0, 2, 3]], acd) and torch.equal(tree[1], ab[1])


def chain_then_alone(engine, prompt: list[int], chain: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`chain`'s logits [n, V] after `prompt`: in one forward, then one token per forward."""
    out = []
    for chunks in ([chain], [[t] for t in chain]):
        cache = engine.make_pool(1, 256).caches[0]
        engine.forward_batch([chain_input(cache, prompt)])
        cache.commit()
        rows = []
        for ch in chunks:
            rows.append(engine.forward_batch([chain_input(cache, ch)])[0])
            cache.commit()
        out.append(torch.cat(rows))
    return out[0], out[1]


def test_the_row_floor_is_what_makes_one_token_equal_its_chain(engine):
    """oneDNN's one-row kernel sums the MLP's down projection in another order (measured on an AVX512-BF16 EPYC:
    1 row in 4 differs in the last bit): with row_floor 1, 16 tokens alone give other logits than the same 16 as
    one chain; with the floor, the same. (On a 2-core AMX Xeon its one-row kernel gave the same bits: the floor is
    not needed there, and the test says so.)"""
    g = torch.Generator().manual_seed(0)
    prompt, chain = (torch.randint(0, 49152, (n,), generator=g).tolist() for n in (100, 16))
    chained, alone = chain_then_alone(engine, prompt, chain)
    assert torch.equal(chained, alone)
    engine.row_floor = 1
    try:
        chained1, alone1 = chain_then_alone(engine, prompt, chain)
    finally:
        engine.row_floor = onednn.ROW_FLOOR
    assert torch.equal(chained1, chained)
    if torch.equal(alone1, alone):
        pytest.skip("on this CPU oneDNN's one-row kernel gives its many-row bits: the row floor is not needed here")


def test_the_int4_engine_computes_the_checkpoints_own_blocks(default_checkpoint, engines):
    """Every layer's weights run on the checkpoint's Q4_1 codes, the LM head on the Q8_0 embedding it is tied to:
    a projection's output is the blocks' dequantized weight applied in fp32, to bf16 rounding; the head's fp32
    logits are that weight's, to fp32 sums."""
    model = engines["int4"].model
    assert all(isinstance(m, Int4Linear) for layer in model.layers for m in layer.modules()
               if isinstance(m, (Int4Linear, PackedLinear)))
    blocks = blocks_by_parameter(default_checkpoint)
    w = torch.from_numpy(blocks["layers.3.mlp.down.weight"].dequantized())  # [576, 1536]
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))
    got = model.layers[3].mlp.down(x.to(torch.bfloat16)).float()
    want = x.to(torch.bfloat16).float() @ w.t()
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
    if int4_kernel.kernel() != "spork":
        assert isinstance(model.lm_head, PackedLinear)
        return
    assert isinstance(model.lm_head, Q8Linear)
    head = torch.from_numpy(blocks["embed.weight"].dequantized()).double()  # [V, C]
    x = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = model.lm_head(x)
    want = x.double() @ head.t()
    # fp32 sums; the avx2 flavor multiplies x in 16 bits per block of 32 (int4_kernel.arithmetic: about 1e-4 here)
    tolerance = 2 ** -12 if int4_kernel.arithmetic() == "avx2" else 1e-5
    assert logits.dtype == torch.float32 and (logits.double() - want).abs().max() < tolerance * want.abs().max()


def test_int4_needs_a_checkpoint_with_4_bit_blocks():
    with pytest.raises(UserError, match="own blocks"):
        onednn.cpu_target(random_checkpoint(tiny_config()), "int4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_spork_on_the_cpu_torch_engine_is_lossless_alone_and_batched(dtype):
    runtime = Runtime.load(None, "cpu", dtype)
    assert runtime.backend == f"torch-cpu-{dtype}" and not runtime.engine.exact_trees
    cfg = GenerateConfig(max_new_tokens=40)
    spec = SpecConfig(draft="ngram", tree_width=3, tree_depth=4, tree_budget=12)  # resolved to a chain of 4
    ids = [runtime.tokenizer.encode_prompt(p) for p in PROMPTS]
    plain = [runtime.generate(p, cfg).token_ids for p in ids]
    for p, want in zip(ids, plain):
        got = runtime.generate(p, cfg, "spork", spec)
        assert got.token_ids == want
    core = EngineCore(runtime.engine, runtime.cfg.vocab_size, CoreConfig(slots=2, max_len=256, prefill_tokens=16))
    out = run_core(core, [runtime.request(p, cfg, "spork" if i else "plain", spec) for i, p in enumerate(ids)])
    assert [out[i].token_ids for i in range(len(ids))] == plain


def test_a_forward_runs_its_sequences_in_slot_order_with_few_free_slots_between_as_padding():
    assert onednn.window_members([4, 0, 2, 3]) == [1, None, 2, 3, 0]  # slots 0..4, slot 1 free: one window
    assert onednn.window_members([3, 1, 2]) == [1, 2, 0]
    assert onednn.window_members([5, 0]) == [1, 0]  # 4 free slots between 2 sequences: gathered instead


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[4, 0, 2, 3], [5, 0]])  # a window with a free slot in it; gathered
def test_a_batch_in_any_slot_order_gives_each_sequence_its_own_logits_in_its_order(engines, dtype, slots):
    engine = engines[dtype]
    prompts = [[5 + 7 * i + j for j in range(9 + 5 * i)] for i in range(len(slots))]
    nexts = [[11 + i, 23 + i] for i in range(len(slots))]
    batched_pool = engine.make_pool(6, 64).caches
    alone = []
    for prompt, nxt in zip(prompts, nexts):  # each alone in slot 0 of its own pool: prefill, then one token
        cache = engine.make_pool(1, 64).caches[0]
        engine.forward_batch([chain_input(cache, prompt)])
        cache.commit()
        alone.append(engine.forward_batch([chain_input(cache, nxt)])[0])  # [2, V]
    caches = [batched_pool[s] for s in slots]
    for cache, prompt in zip(caches, prompts):
        engine.forward_batch([chain_input(cache, prompt)])
        cache.commit()
    batched = engine.forward_batch([chain_input(c, nxt) for c, nxt in zip(caches, nexts)])
    for got, want in zip(batched, alone):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[0, 1], [2, 0]])  # consecutive slots: a view of the pool; others: gathered
@pytest.mark.parametrize("real", [list(range(10)), [0, 1, 2, 3, 4, 5, 6, 7, 8]])  # all rows; the last one padding
def test_the_engines_lean_forward_computes_the_models_values(engines, fp32_logits, dtype, slots, real):
    """engines/cpu/forward.py claims the reference model's arithmetic in fewer ops, its layers run by TorchScript
    on the real rows only (packed): the same logits and tapped hidden states at those rows, bit for bit, as
    model.Transformer.forward over the same packed modules, pool and window, which computes every row. On spork's
    CPU kernels (fused_layers, where built: other arithmetic, fp32 inside each op and a fp32 residual stream), the
    fp32 model's argmax, and nearer its logits than ATen's bf16 path; on int4 as one native op (spork::int4_layers),
    fused_layers' bits: logits, tapped hidden states and the K/V rows written."""
    import dataclasses

    from spork_trt.engines.cpu import forward as cpu_forward
    from spork_trt.engines.cpu.engine import WindowKV

    assert isinstance(cpu_forward.scripted(False), torch.jit.ScriptFunction)  # not the Python fallback
    assert isinstance(cpu_forward.scripted(True), torch.jit.ScriptFunction)
    engine = engines[dtype]
    weights = dataclasses.replace(engine.weights, fused=False, native=False)
    scripted = dataclasses.replace(engine.weights, native=False)  # fused_layers by TorchScript
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (2, 5), generator=g)
    pos = torch.arange(5).repeat(2, 1)
    mask = torch.ones(2, 5, 64, dtype=torch.bool).tril(0)  # [B, T, C]: position p attends 0..p
    write = pos.clone()
    taps = (3, 1)
    out = []
    for run in (lambda kv: cpu_forward.forward(engine.model, weights, ids, pos, mask, kv, taps,
                                               torch.arange(len(real)), torch.tensor(real)),
                lambda kv: engine.model(ids, pos, mask, kv=kv, taps=taps, logit_rows=torch.tensor(real)),
                lambda kv: cpu_forward.forward(engine.model, engine.weights, ids, pos, mask, kv, taps,
                                               torch.arange(len(real)), torch.tensor(real)),
                lambda kv: cpu_forward.forward(engine.model, scripted, ids, pos, mask, kv, taps,
                                               torch.arange(len(real)), torch.tensor(real))):
        pool = engine.make_pool(3, 256).caches[0].device_slot[0]
        with torch.inference_mode():
            out.append((run(WindowKV(pool, slots, write, 64)), pool))
    (lean, _), (model, _), (fused, pool), (script, script_pool) = out
    assert torch.equal(lean.logits, model.logits)
    assert torch.equal(lean.hidden, model.hidden.reshape(10, -1)[real])  # [N, k*C]
    if engine.weights.fused:
        ref = fp32_logits[real]
        near = (fused.logits.float() - ref).abs().mean()  # measured 0.13-0.15 (logits up to ~25)
        assert near < 0.5 * (model.logits.float() - ref).abs().mean()  # measured 0.69-0.70: bf16 residual stream
        assert torch.equal(fused.logits.argmax(-1), ref.argmax(-1))
    assert engine.weights.native == (dtype == "int4" and engine.weights.fused)
    assert torch.equal(fused.logits, script.logits) and torch.equal(fused.hidden, script.hidden)
    assert torch.equal(pool.k, script_pool.k) and torch.equal(pool.v, script_pool.v)


@pytest.fixture(scope="module")
def fp32_logits(default_checkpoint):
    """The fp32 checkpoint's logits [10, V] for the lean-forward test's two 5-token sequences (all rows)."""
    from spork_trt.engines.torch_engine import TorchEngine

    engine = TorchEngine(default_checkpoint.model)
    ids = torch.randint(0, 49152, (2, 5), generator=torch.Generator().manual_seed(1))  # the test's ids
    return torch.cat([engine.forward_batch([chain_input(engine.make_pool(1, 64).caches[0], seq.tolist(),
                                                        tuple(range(5)))])[0] for seq in ids]).float()


def test_p_at_v_over_a_long_window_is_the_same_whatever_columns_follow():
    """oneDNN's bf16 bmm sums a row over more than 1024 columns in an order that depends on how many there are
    (on an AVX512-BF16 EPYC; not on a 2-core AMX Xeon, where the test says so): masked (zero) columns added past
    1024 change a row's P @ V. cpu_forward.attend sums in chunks of 1024: the same
    bits with or without the extra columns, and a window of at most 1024 columns is the plain bmm."""
    from spork_trt.engines.cpu.forward import PV_CHUNK, attend

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1000, 3, 1001, generator=g) * 3, -1).to(torch.bfloat16)  # [N, M, 1001]
    values = torch.randn(1000, 1152, 64, generator=g).to(torch.bfloat16)  # [N, C, D]
    longer = torch.cat([probs, torch.zeros(1000, 3, 151, dtype=torch.bfloat16)], -1)  # 1152 columns, the last zero
    short = torch.cat([probs, torch.zeros(1000, 3, 23, dtype=torch.bfloat16)], -1)  # 1024 columns
    assert torch.equal(attend(short, values[:, :1024], PV_CHUNK), attend(longer, values, PV_CHUNK))
    assert torch.equal(attend(short, values[:, :1024], PV_CHUNK), torch.bmm(short, values[:, :1024]))
    if torch.equal(torch.bmm(short, values[:, :1024]), torch.bmm(longer, values)):  # the premise, on this CPU
        pytest.skip("on this CPU oneDNN's bmm gives a row the same bits past 1024 columns (seen on a 2-core AMX "
                    "Xeon): the chunks are not needed here")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_after_a_long_context_is_the_same_beside_a_longer_one(engines, dtype):
    """A token after 900 tokens of context (a 960-column window alone) gives the same logits in a batch beside a
    sequence of 1,400 (a 1,408-column window for both): the attention's columns past 1024 change nothing."""
    engine = engines[dtype]
    pool = engine.make_pool(2, 2048)
    a, b = pool.caches
    for cache, n, step in ((a, 900, 7), (b, 1400, 11)):
        engine.forward_batch([chain_input(cache, [(step * i) % 30000 + 5 for i in range(n)], (n - 1,))])
        cache.commit()
    alone = engine.forward_batch([chain_input(a, [42], (0,))])[0]
    a.forget(0)
    beside = engine.forward_batch([chain_input(a, [42], (0,)), chain_input(b, [43], (0,))])[0]
    assert torch.equal(alone, beside)
