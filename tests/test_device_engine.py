"""The device engine (engines/device_engine.py: the GPU engine's code, run eagerly on the CPU here): its bucketed
static-shape forward over the pool equals the reference engine's, requests batched through the engine core equal
plain decoding alone, spork with it is lossless, and asking for CUDA without a GPU is one clear error."""
from __future__ import annotations

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.spec.drafters import NgramDrafter
from spork_trt.engines import SeqInput, chain_input
from spork_trt.engines.device_engine import DeviceEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import UserError
from spork_trt.loop.generate import generate
from spork_trt.loop.request import Submission
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import run_core, tiny_config

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 3, 3, 17, 22, 9], [5] * 3 + [6, 7] * 5, [9, 9, 8]]


@pytest.fixture(scope="module")
def target():
    return random_checkpoint(tiny_config(vocab_size=48, n_layers=3), seed=11, scale=8.0).model


def device(target, **kw) -> DeviceEngine:
    return DeviceEngine(target, "cpu", "fp32", **kw)


def test_bucketed_forward_equals_the_reference(target):
    """Three sequences on slots 0, 2, 3 of a pool (slot 1 a padding row), prompts then a tree each: logits at the
    asked-for rows and the slots' cache rows equal the reference engine's."""
    dev, ref = device(target), TorchEngine(target)
    pools = [dev.make_pool(4, 40), ref.make_pool(4, 40)]
    slots = [0, 2, 3]
    outs = []
    for eng, pool in zip((dev, ref), pools):
        first = eng.forward_batch([chain_input(pool.caches[s], p, (len(p) - 1,)) for s, p in zip(slots, PROMPTS)])
        for s in slots:
            pool.caches[s].commit()
        anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, then two children
        trees = [SeqInput(pool.caches[s], (5, 6, 7), (len(p),) * 1 + (len(p) + 1,) * 2, anc)
                 for s, p in zip(slots, PROMPTS)]
        outs.append((first, eng.forward_batch(trees)))
    for (a1, a2), (b1, b2) in [(outs[0], outs[1])]:
        for x, y in zip(a1 + a2, b1 + b2):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4)
    for s, p in zip(slots, PROMPTS):
        c, r = pools[0].caches[s], pools[1].caches[s]
        assert c.length == r.length == len(p) and c.pending == r.pending == 3
        n = len(p) + 3
        assert torch.allclose(c.k[:, :, :, :n], r.k[:, :, :, :n], atol=1e-5)


def test_batched_requests_equal_plain_alone(target):
    dev = device(target)
    core = EngineCore(dev, 256, CoreConfig(slots=3, max_len=96, prefill_tokens=5))
    spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=8)
    reqs = [Submission(p, GenerateConfig(max_new_tokens=30), spec=spec, drafter=NgramDrafter(4) if i % 2 else None)
            for i, p in enumerate(PROMPTS)]
    out = run_core(core, reqs)
    for i, p in enumerate(PROMPTS):
        want = generate(TorchEngine(target), p, GenerateConfig(max_new_tokens=30), frozenset()).token_ids
        assert out[i].token_ids == want


@pytest.mark.parametrize("width,depth", [(1, 4), (3, 5)])
def test_spork_on_the_device_engine_is_lossless(target, width, depth):
    spec = SpecConfig(tree_width=width, tree_depth=depth, tree_budget=width * depth)
    for p in PROMPTS:
        got = generate(device(target), p, GenerateConfig(max_new_tokens=40), frozenset(), drafter=NgramDrafter(4),
                       spec=spec)
        assert got.token_ids == generate(device(target), p, GenerateConfig(max_new_tokens=40), frozenset()).token_ids


class OnDevice(torch.Tensor):
    """A CPU tensor that behaves like one on a GPU where it matters here: ops mixing it with a host tensor (other
    than a 0-dim one) or a host generator fail, .numpy() fails; .cpu() brings it to the host; .tolist(), int()
    and float() read it (a synchronizing copy on CUDA)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cpu,):
            return args[0].as_subclass(torch.Tensor).clone()
        if func in (torch.Tensor.numpy,):
            raise RuntimeError("can't convert a device tensor to numpy: copy it to the host first")
        flat = [*args, *kwargs.values()]
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        if any(type(a) is torch.Tensor and a.dim() > 0 for a in flat):
            raise RuntimeError(f"{func.__name__}: expected all tensors on the same device, found a host tensor")
        if kwargs.get("generator") is not None:
            raise RuntimeError(f"{func.__name__}: a host generator with a device tensor")
        return super().__torch_function__(func, types, args, kwargs)


class LogitsOnDevice(DeviceEngine):
    """The device engine with its logits marked as living on a device (OnDevice)."""

    def run(self, entries, hidden):
        return [x.as_subclass(OnDevice) for x in super().run(entries, hidden)]


def test_logits_stay_on_the_device_and_verification_reads_them_there(target):
    """The device engine's logits stay on its device: the engine core verifies with them there (greedy argmax on
    the device, sampling's processed distribution copied to the host) and is still lossless, batched and alone;
    the host-tensor guard itself fires."""
    with pytest.raises(RuntimeError, match="host tensor"):
        torch.zeros(3).as_subclass(OnDevice) + torch.ones(3)
    assert type(device(target).forward_batch([chain_input(device(target).make_cache(20), [1, 2, 3])])[0]) \
        is torch.Tensor
    spec = SpecConfig(tree_width=3, tree_depth=4, tree_budget=8)
    for sampling in (GenerateConfig().sampling, SamplingConfig(temperature=0.8, top_p=0.9, seed=3)):
        cfg = GenerateConfig(max_new_tokens=30, sampling=sampling)
        outs = []
        for eng in (LogitsOnDevice(target, "cpu", "fp32"), device(target)):
            core = EngineCore(eng, 256, CoreConfig(slots=3, max_len=96, prefill_tokens=5))
            outs.append(run_core(core, [Submission(p, cfg, spec=spec, drafter=NgramDrafter(4) if i % 2 else None)
                                        for i, p in enumerate(PROMPTS)]))
        for i, p in enumerate(PROMPTS):
            assert outs[0][i].token_ids == outs[1][i].token_ids and len(outs[0][i].token_ids) == 30
            if sampling.greedy:
                assert outs[0][i].token_ids == generate(device(target), p, cfg, frozenset()).token_ids


def test_half_precision_runs_and_cuda_needs_a_gpu(target):
    out = generate(DeviceEngine(target, "cpu", "bf16"), PROMPTS[0], GenerateConfig(max_new_tokens=8), frozenset())
    assert len(out.token_ids) == 8
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees no CUDA device"):
            DeviceEngine(target, "cuda")
    with pytest.raises(UserError, match="--dtype"):
        DeviceEngine(target, "cpu", "fp8")


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    """`python -m bench gpu` (what bench/gpu_check.sh runs on a GPU) on the real default model, eagerly on the CPU
    with two prompts: parity with the reference engine, lossless spork, batched == one at a time."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "bench", "gpu", "--device", "cpu", "--dtype", "fp32", "--limit", "2",
                        "--max-new-tokens", "12", "--batch", "2", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["parity"] == {"identical": 2, "of": 2} and res["batched"]["identical_to_batch_1"] == 2
    assert res["bf16"]["top1_agreement"] == 1.0  # fp32 vs fp32 here
    assert all(s["mismatches"] == 0 for s in res["spork"].values())
    assert set(res["spork"]) == {"ngram", "store", "store-wide"}
    from bench.gpu_summary import lines  # gpu_check.sh all's summary of it: one line per arm
    summary = lines(tmp_path)
    assert len(summary) == 5 and summary[2].startswith(f"{tmp_path.name}: spork/store ") and "0 mismatches" in summary[2]
    assert lines(tmp_path / "absent") == ["absent: no gpu_check.json"]


def test_profile_tools_measure_every_token_bucket_and_write_their_tables(target, tmp_path):
    """bench gpu --profile's parts (bench/gpu_profile.py) on the tiny model, eagerly: a cost per token bucket (no
    graph to replay on the CPU), and the three profile tables written over a real generation."""
    from bench.gpu_profile import TOKENS, forward_costs, op_tables

    costs = forward_costs(device(target), vocab=48, reps=2)
    assert list(costs) == [str(t) for t in TOKENS]
    assert all(c["call_ms"] > 0 and c["replay_ms"] is None and c["bucket"] == int(t) for t, c in costs.items())
    files = op_tables(lambda: generate(device(target), PROMPTS[0], GenerateConfig(max_new_tokens=4), frozenset()),
                      tmp_path)
    assert "linear" in (tmp_path / files["py"]).read_text()
    assert "aten::" in (tmp_path / files["cpu"]).read_text()


def test_a_forward_pads_to_a_faster_larger_bucket_and_computes_the_same(target):
    """With lookahead (on by default under CUDA graphs; set here for the eager engine) a forward takes the fastest
    of its bucket and the next two: with larger buckets timed faster, 8-token prompts run padded to 32 and 3-token
    trees to 16, and their logits and cache rows equal the reference's; timing a bucket writes no row a sequence holds."""
    dev, ref = device(target), TorchEngine(target)
    dev.lookahead = 2
    pools = [dev.make_pool(2, 80), ref.make_pool(2, 80)]
    pool = pools[0].caches[0].device_slot[0]
    for t, ms in ((4, 3.0), (8, 3.0), (16, 2.0), (32, 1.0)):
        dev.bucket(pool, 2, t).ms = ms  # as if timed: 32 rows fastest
    outs = []
    for eng, kv in zip((dev, ref), pools):
        first = eng.forward_batch([chain_input(kv.caches[s], PROMPTS[s], (len(PROMPTS[s]) - 1,)) for s in (0, 1)])
        for s in (0, 1):
            kv.caches[s].commit()
        anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        trees = [SeqInput(kv.caches[s], (5, 6, 7), (len(PROMPTS[s]),) + (len(PROMPTS[s]) + 1,) * 2, anc)
                 for s in (0, 1)]
        outs.append(first + eng.forward_batch(trees))
    ran = {t for (_, t), buf in pool.buckets.items() if buf.logits is not None}
    assert ran == {32, 16}  # the prompts (8 tokens: 8, 16 or 32) padded to 32; the trees (3: 4, 8 or 16) to 16
    for x, y in zip(*outs):
        assert torch.allclose(x, y, atol=1e-4)
    for s in (0, 1):
        n = len(PROMPTS[s]) + 3
        assert torch.allclose(pools[0].caches[s].k[:, :, :, :n], pools[1].caches[s].k[:, :, :, :n], atol=1e-5)
    wide = dev.make_pool(16, 40).caches[0].device_slot[0]
    for t, ms in ((8, 2.0), (16, 1.0), (32, 0.5)):
        dev.bucket(wide, 16, t).ms = ms
    assert dev.pick(wide, 16, 8) == 16  # 16 x 32 rows is past LOOKAHEAD_ROWS: not a candidate, however fast
    assert dev.pick(wide, 16, 100) == 128  # the last bucket has no larger one
    cfg = GenerateConfig(max_new_tokens=30)
    timed = device(target)
    timed.lookahead = 2  # every bucket it meets is timed (eagerly) before use
    spec = SpecConfig(tree_width=3, tree_depth=5, tree_budget=15)
    for p in PROMPTS:
        want = generate(TorchEngine(target), p, cfg, frozenset()).token_ids
        assert generate(timed, p, cfg, frozenset(), drafter=NgramDrafter(4), spec=spec).token_ids == want


def test_a_pool_whose_views_are_gone_is_reused_with_its_buckets(target):
    """run_alone makes a pool per request: once every slot view of one is gone, the next make_pool of the same slots
    and rounded length takes it (its buckets, i.e. its captured graphs, kept); a pool still in use never is; and
    requests run one after another on reused pools give plain decoding's tokens."""
    import gc
    dev = device(target)
    first = dev.make_pool(2, 100)
    pool = first.caches[0].device_slot[0]
    dev.bucket(pool, 2, 4)
    busy = dev.make_pool(2, 100)  # the first is alive: a new one
    assert busy.caches[0].device_slot[0] is not pool
    del first
    gc.collect()
    again = dev.make_pool(2, 300)  # 100 and 300 both round to POOL_ROUND positions
    assert again.caches[0].device_slot[0] is pool and (2, 4) in pool.buckets
    assert again.caches[1].max_len == 300 and dev.make_pool(1, 100).caches[0].device_slot[0] is not pool
    cfg = GenerateConfig(max_new_tokens=20)
    for p in PROMPTS * 2:
        want = generate(TorchEngine(target), p, cfg, frozenset()).token_ids
        assert generate(dev, p, cfg, frozenset(), drafter=NgramDrafter(4)).token_ids == want
    assert len(dev.spare.pools) <= 2
