"""`python -m export build` on the real default model, and the ONNX Runtime engine's parity with the torch engine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spork_trt.engines.onnx_engine import OnnxEngine
from spork_trt.checkpoint.transformer import causal_mask
from tests.conftest import mt_bench_prompts

pytestmark = pytest.mark.slow


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)


def test_build_writes_manifest_and_is_idempotent(default_engines):
    m = json.loads((default_engines / "manifest.json").read_text())
    assert m["format_version"] == 1 and m["model"]["n_layers"] == 30 and m["model"]["family"] == "llama"
    assert set(m["engines"]) == {"target", "verifier", "self-int8", "self-int4", "store"}
    assert m["engines"]["store"]["from"].startswith("shipped ")  # the corpus the package ships for this model
    for name in ("target.onnx", "verifier.onnx", "draft_int8.onnx", "draft_int4.onnx", "tokenizer.json",
                 "store_tokens.npy", "store_sa.npy"):
        assert name in m["artifacts"] and len(m["artifacts"][name]["sha256"]) == 64
    assert len(m["source"]["sha256"]) == 64 and "onnxruntime" in m["tools"]
    assert m["build_inputs"]["attention"] == "gqa"  # ONNX Runtime CPU: GroupQueryAttention graphs
    again = run("export", "build", "--out", str(default_engines))
    assert again.returncode == 0 and "up to date" in again.stderr
    shown = run("export", "inspect", str(default_engines), "--verify")
    assert shown.returncode == 0 and "target.onnx" in shown.stdout and "match their sha256" in shown.stdout
    assert "backend: onnx (gqa attention graphs)" in shown.stdout
    if "int4 on the CPU torch engine" in shown.stdout:  # the default target here: which blocks run how
        assert "  its weights: Q4_1 layer weights on their own blocks" in shown.stdout, shown.stdout
        assert "the Q8_0 LM head on its blocks" in shown.stdout or "the LM head in bf16" in shown.stdout


def test_onnxruntime_logits_match_the_torch_engine(default_engines, default_checkpoint, default_tokenizer):
    ids = (default_tokenizer.encode_prompt(mt_bench_prompts(1)[0]) * 4)[:64]
    engine = OnnxEngine(default_engines / "target.onnx", default_checkpoint.cfg)
    got = engine.forward(engine.make_cache(80), torch.tensor([ids]), torch.arange(64)[None], causal_mask(0, 64))
    with torch.no_grad():
        want = default_checkpoint.model(torch.tensor([ids]), torch.arange(64)[None], causal_mask(0, 64)).logits
    assert (got - want).abs().max() <= 1e-3


def test_bench_costs_times_batched_forwards(default_engines):
    r = run("bench", "costs", "--engines", str(default_engines), "--nodes", "1,2", "--repeats", "1", "--context", "40",
            "--prefill-chunk", "8", "--batch", "3", "--batch-tokens", "1,3:1", "--json")
    assert r.returncode == 0, r.stderr
    batches = json.loads(r.stdout)["batches"]
    assert [(b["batch"], b["tokens"]) for b in batches] == [(3, "1"), (3, "3:1")] and all(b["ms"] > 0 for b in batches)
    bad = run("bench", "costs", "--engines", str(default_engines), "--batch", "3", "--batch-tokens", "4:x")
    assert bad.returncode == 2 and "expected entries T or A:T" in bad.stderr


def test_generate_uses_built_engines(default_engines):
    r = run("spork_trt", "generate", "What is the capital of Japan?", "--engines", str(default_engines),
            "--draft", "self-int8", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Tokyo" in out["text"] and out["stats"]["draft_tokens"] > 0


@pytest.mark.parametrize("args,needle", [
    (["export", "build", "--verifier-layers", "30", "--out", "/tmp/spork-never"], "--verifier-layers must be in"),
    (["export", "build", "--backend", "tensorrt"], "`tensorrt` Python package"),
    (["export", "build", "--precision", "fp16"], "fp16/bf16 with --backend tensorrt"),
    (["export", "build", "--draft", "self-int3"], "buildable drafts are self-int8, self-int4"),
    (["export", "build", "--backend", "tensorrt", "--precision", "int4"], "not buildable for TensorRT"),
    (["export", "build", "--head", "/no/such/head", "--out", "/tmp/spork-never"], "--head /no/such/head: use auto"),
    (["spork_trt", "generate", "hi", "--draft", "eagle"], "--draft eagle needs a build with a draft head"),
    (["export", "inspect", "/no/such/engines"], "has no manifest.json"),
    (["spork_trt", "generate", "hi", "--engines", "/no/such/engines"], "has no manifest.json"),
])
def test_export_bad_input_is_one_line(args, needle):
    r = run(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 or r.stderr.count("error:") == 1


def test_draft_auto_is_the_store_where_the_engines_have_one(default_engines, default_runtime):
    from spork_trt.config import SpecConfig
    from spork_trt.loop.runtime import Runtime

    rt = Runtime.from_engines(default_engines)
    assert rt.default_draft == "store" and rt.resolve(SpecConfig.for_draft("auto")).draft == "store"
    assert default_runtime.default_draft == "ngram"  # the torch engine from a checkpoint: no datastore


def test_build_with_a_draft_head_drafts_with_it(default_engines, default_checkpoint, tmp_path):
    """An untrained head for the default target (LM head rows copied from the target's): the build adds it, its
    ONNX step and the target graph's hidden-state output, `--draft eagle` drafts with it and stays token-identical
    to plain; a head made for another checkpoint is refused."""
    from spork_trt.spec.draft_head import DraftHead, HeadConfig

    model = default_checkpoint.model
    head = DraftHead(HeadConfig.for_target(model.cfg, (30,), 512))
    head.init_from_target(model, torch.arange(512))
    sha = json.loads((default_engines / "manifest.json").read_text())["source"]["sha256"]
    head.save(tmp_path / "head", {"target_sha256": sha})
    head.save(tmp_path / "other", {"target_sha256": "0" * 64})
    bad = run("export", "build", "--out", str(tmp_path / "never"), "--head", str(tmp_path / "other"))
    assert bad.returncode == 2 and "another checkpoint" in bad.stderr
    out = tmp_path / "engines"
    r = run("export", "build", "--out", str(out), "--head", str(tmp_path / "head"), "--draft", "self-int4")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["engines"]["target"]["taps"] == [30] and m["engines"]["head"]["vocab"] == 512 and "eagle" in m["drafters"]
    assert m["engines"]["head"]["graph"] == "head.onnx" and "head.onnx.data" in m["artifacts"]  # its ONNX step
    for prompt in mt_bench_prompts(2):
        got = [json.loads(run("spork_trt", "generate", prompt, "--engines", str(out), "--max-new-tokens", "48",
                              "--json", *mode).stdout) for mode in (["--draft", "eagle"], ["--mode", "plain"])]
        assert got[0]["token_ids"] == got[1]["token_ids"] and got[0]["stats"]["draft_tokens"] > 0
    # `export calibrate --draft eagle` collects the head's trees with the verifier scoring them; this untrained
    # head gets none accepted, which fitting refuses in one line (a trained one fits: README)
    cal = run("export", "calibrate", "--engines", str(out), "--draft", "eagle", "--limit", "1", "--max-new-tokens", "16")
    assert cal.returncode == 2 and "labelled nodes" in cal.stderr, cal.stderr
    assert "needs both accepted and rejected nodes" in cal.stderr.splitlines()[-1]
