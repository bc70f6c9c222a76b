"""Shared fixtures: tiny seeded random models (fast invariants) and the real default model (session-scoped)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from spork_trt.config import ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, os.cpu_count() or 1))



def tiny_config(**over) -> ModelConfig:
    base = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256,
                rope_theta=10000.0, tie_embeddings=True, eos_token_ids=())
    base.update(over)
    return ModelConfig(**base)


def write_selfdata(target, d: Path, n: int = 160, new_tokens: int = 40) -> Path:
    """A self-data folder in `d`: the target's greedy continuations of `n` seeded random 6-token prompts."""
    from spork_trt.config import GenerateConfig
    from spork_trt.engines.torch_engine import TorchEngine
    from spork_trt.loop.generate import generate

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        prompt = torch.randint(0, target.cfg.vocab_size, (6,), generator=g).tolist()
        out = generate(TorchEngine(target), prompt, GenerateConfig(max_new_tokens=new_tokens), frozenset()).token_ids
        rows.append({"id": f"s{i}", "ids": prompt + out, "n_prompt": 6, "stop": "max_tokens"})
    (d / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def core_requests(core, subs: list, join_at: dict[int, int] | None = None) -> list:
    """Step until every submission's request is done; submission i joins at step join_at[i] (default 0). Returns
    their Requests (the core's state), in submission order."""
    join_at, steps, added = join_at or {}, 0, {}
    while len(added) < len(subs) or not core.idle:
        for i in [i for i in range(len(subs)) if i not in added and join_at.get(i, 0) <= steps]:
            added[i] = core.add(subs[i])
        core.step()
        steps += 1
        assert steps < 2000
    assert all(r.finished for r in added.values())
    return [added[i] for i in range(len(subs))]


def run_core(core, subs: list, join_at: dict[int, int] | None = None) -> dict:
    """Step until every submission's request is done (core_requests); their results, by submission index."""
    return dict(enumerate(r.result() for r in core_requests(core, subs, join_at)))


@pytest.fixture(scope="session")
def default_checkpoint():
    from spork_trt.checkpoint.weights import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="session")
def default_tokenizer(default_checkpoint):
    from spork_trt.checkpoint.tokenizer import load_tokenizer

    ck = default_checkpoint
    return load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)


def mt_bench_prompts(n: int) -> list[str]:
    """The first turn of the first `n` MT-bench questions, one per category in turn."""
    from spork_trt.prompts import data_file

    rows = [json.loads(line) for line in data_file("mt_bench", "question.jsonl").read_text().splitlines() if line]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    order = [q for group in zip(*by_cat.values()) for q in group]
    return order[:n]


def humaneval_prompts(n: int) -> list[str]:
    from bench.prompts import load_prompts

    return [r["prompt"] for r in load_prompts("humaneval", n)]


@pytest.fixture(scope="session")
def default_runtime():
    from spork_trt.loop.runtime import Runtime

    return Runtime.load()


@pytest.fixture(scope="session")
def default_engines(tmp_path_factory):
    """`python -m export build` of the default model, once per session (about 40 s)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("engines") / "default"
    r = subprocess.run([sys.executable, "-m", "export", "build", "--out", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    return out


def onnx_head_step_matching(head, d: Path):
    """head.onnx exported from `head` (engines.onnx_head.OnnxHead), checked against the torch head: the same outputs
    and new KV rows over a cache, for a chain and then rows after it."""
    from spork_trt.engines.onnx_head import OnnxHead
    from spork_trt.export.onnx_graph import export_head_onnx
    from spork_trt.engines.kv_cache import KVCache
    from spork_trt.checkpoint.transformer import causal_mask

    step = OnnxHead(export_head_onnx(head, d / "head.onnx"), head.hc.layer_config())
    gen = torch.Generator().manual_seed(5)
    emb, g = (torch.randn(1, 7, head.hc.dim, generator=gen) for _ in range(2))
    ref_cache, cache = KVCache(head.hc.layer_config(), 16), step.make_cache(16)
    for lo, hi in ((0, 4), (4, 7)):
        mask = causal_mask(lo, hi - lo)
        pos = torch.arange(lo, hi)[None]
        with torch.no_grad():
            want = head(emb[:, lo:hi], g[:, lo:hi], pos, mask, ref_cache)
        got = step(emb[:, lo:hi], g[:, lo:hi], pos, mask, cache)
        for c in (ref_cache, cache):
            c.written(hi - lo)
            c.commit()
        for w, x in zip(want, got):
            assert x.shape == w.shape and torch.allclose(x, w, atol=1e-4)
    assert torch.allclose(torch.from_numpy(cache.k[0, 0, :7]), ref_cache.k[0, 0, :, :7].transpose(0, 1), atol=1e-4)
    assert torch.allclose(torch.from_numpy(cache.v[0, 0, :7]), ref_cache.v[0, 0, :, :7].transpose(0, 1), atol=1e-4)
    return step
