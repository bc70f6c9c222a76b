"""`python -m bench gpu`: the GPU engine's check (engines/device_engine.py), what bench/gpu_check.sh runs on a lent
GPU; on the CPU (`--device cpu`, small --limit) it checks itself. Writes OUT/gpu_check.json:

  parity      fp32 on the device vs the CPU reference engine: greedy tokens identical per prompt
  bf16        logits of the device engine in bf16 vs fp32 on the first prompt: max |diff|, top-1 agreement
  plain       greedy tokens/s of the device engine (`--dtype`, CUDA graphs on a GPU), batch 1
  hf          Hugging Face `generate` (greedy) on the same device and weights, batch 1 (skipped without transformers)
  spork       n-gram and the store drafter (the shipped corpus) at batch 1, the store also in a wide tree (WIDE):
              tokens/s, speedup over plain of the same engine, mismatches against it
  batched     every prompt at once through the engine core (`--batch` slots) vs one at a time: output tokens/s
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.loop.request import Submission
from spork_trt.spec.datastore import Datastore
from spork_trt.draft_kinds import NGRAM, STORE
from spork_trt.spec.drafters import NgramDrafter, StoreDrafter
from spork_trt.engines import forward_chain
from spork_trt.engines.device_engine import DeviceEngine
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.export.artifacts import load_corpus, shipped
from spork_trt.loop.generate import generate, run_many
from spork_trt.prompts import load_prompts
from spork_trt.checkpoint.tokenizer import load_tokenizer
from spork_trt.checkpoint.weights import load_checkpoint

# the store's tree for a GPU, where a 64-node forward costs about 1.4 one-token ones (issue 18's measurement):
# `python -m bench replay --shapes default,8x8x64 --costs 1:2.2,16:3.0,64:3.1,256:3.3` estimates it commits 7-17%
# more per step than the CPU's 3x6x12, for 1-6% more speed (README, "What the store can reach")
WIDE = (8, 8, 64)


def stage(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def timed(engine, prompts: list[list[int]], cfg: GenerateConfig, eos, drafter=None, spec=SpecConfig()) -> dict:
    """Greedy runs one at a time: outputs, tokens/s, tokens per step, and a decode step's milliseconds: all of it,
    drafting (propose), and the target forward with verification and commit (verify); the rest is the loop's host
    work (scheduling, trees, streaming), which weighs more the faster the forward."""
    outs, tokens, steps, t = [], 0, 0, time.perf_counter()
    step_s = propose_s = verify_s = 0.0
    for p in prompts:
        r = generate(engine, p, cfg, eos, drafter=drafter() if drafter else None, spec=spec)
        outs.append(r.token_ids)
        st = r.stats
        tokens, steps = tokens + st.committed_tokens, steps + st.steps
        step_s, propose_s, verify_s = step_s + st.time_s - st.prefill_s, propose_s + st.propose_s, \
            verify_s + st.verify_s
    s, n = time.perf_counter() - t, max(steps, 1)
    return {"outputs": outs, "tokens": tokens, "seconds": round(s, 2), "tokens_per_s": round(tokens / s, 1),
            "tokens_per_step": round(tokens / n, 2), "step_ms": round(1e3 * step_s / n, 3),
            "propose_ms": round(1e3 * propose_s / n, 3), "verify_ms": round(1e3 * verify_s / n, 3)}


def hf_speed(ck, device: str, dtype: torch.dtype, prompts: list[list[int]], max_new: int, eos) -> dict:
    try:
        from bench.peers import load_hf, until_eos
        hf = load_hf(ck).to(device, dtype)
    except ImportError as e:
        return {"skipped": f"transformers is not importable here ({e})"}
    tokens, t = 0, time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])[0, len(p):].tolist()
            tokens += len(until_eos(out, max_new, eos))
    s = time.perf_counter() - t
    return {"tokens": tokens, "seconds": round(s, 2), "tokens_per_s": round(tokens / s, 1)}


def main(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ck = load_checkpoint(a.model)
    tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
    eos = tok.eos_ids
    prompts = [tok.encode_prompt(r["prompt"]) for r in load_prompts(a.prompts, a.limit)]
    cfg = GenerateConfig(max_new_tokens=a.max_new_tokens)
    res: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
                 "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "dtype": a.dtype}

    if a.profile:
        return profile(a, res, ck, prompts, cfg, eos, shipped_store(ck), out)
    stage("parity: fp32 on the device vs the CPU reference engine")
    dev32 = DeviceEngine(ck.model, a.device, "fp32")
    ref = timed(TorchEngine(ck.model), prompts, cfg, eos)
    got = timed(dev32, prompts, cfg, eos)
    res["parity"] = {"identical": sum(x == y for x, y in zip(got["outputs"], ref["outputs"])), "of": len(prompts)}
    stage(f"parity: {res['parity']}")

    stage(f"{a.dtype} logits vs fp32 on the first prompt")
    low = DeviceEngine(ck.model, a.device, a.dtype)
    logits = []
    for eng in (dev32, low):
        logits.append(forward_chain(eng, eng.make_cache(len(prompts[0]) + 1), prompts[0]))  # [n, V]
    diff = (logits[0] - logits[1]).abs()
    res["bf16"] = {"max_abs_diff": round(float(diff.max()), 4), "mean_abs_diff": round(float(diff.mean()), 5),
                   "top1_agreement": round(float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()), 4)}

    stage(f"plain, {a.dtype}, batch 1")
    plain = timed(low, prompts, cfg, eos)
    stage("Hugging Face generate, same device and weights")
    res["hf"] = hf_speed(ck, a.device, torch.float32 if a.dtype == "fp32" else getattr(torch, {
        "bf16": "bfloat16", "fp16": "float16"}[a.dtype]), prompts, a.max_new_tokens, eos)
    res["plain"] = {k: v for k, v in plain.items() if k != "outputs"}
    if "tokens_per_s" in res["hf"]:
        res["plain"]["x_hf"] = round(plain["tokens_per_s"] / res["hf"]["tokens_per_s"], 2)

    store = shipped_store(ck)
    res["spork"] = {}
    with_store = (lambda: StoreDrafter(NgramDrafter(4), store)) if store else None
    for name, make, spec in ((NGRAM.name, lambda: NgramDrafter(4), SpecConfig.for_draft(NGRAM.name)),
                             (STORE.name, with_store, SpecConfig.for_draft(STORE.name)),
                             (STORE.name + "-wide", with_store, SpecConfig.for_draft(STORE.name, *WIDE))):
        if make is None:
            continue
        stage(f"spork/{name}, batch 1")
        r = timed(low, prompts, cfg, eos, make, spec)
        res["spork"][name] = {**{k: v for k, v in r.items() if k != "outputs"},
                              "x_plain": round(r["tokens_per_s"] / plain["tokens_per_s"], 2),
                              "mismatches": sum(x != y for x, y in zip(r["outputs"], plain["outputs"]))}

    stage(f"batched: {len(prompts)} requests on {a.batch} slots")
    subs = [Submission(p, cfg, eos) for p in prompts]
    t = time.perf_counter()
    done = list(run_many(low, subs, a.batch, max(map(len, prompts)) + a.max_new_tokens + 32))
    s = time.perf_counter() - t
    tokens = sum(len(r.result().token_ids) for r in done)
    res["batched"] = {"slots": a.batch, "tokens": tokens, "seconds": round(s, 2), "tokens_per_s": round(tokens / s, 1),
                      "x_batch_1": round(tokens / s / plain["tokens_per_s"], 2),
                      "identical_to_batch_1": sum(r.result().token_ids == plain["outputs"][subs.index(r.sub)]
                                                  for r in done)}
    return write(out, res)


def shipped_store(ck) -> Datastore | None:
    """The datastore of the corpus shipped for this checkpoint, if one ships."""
    found = shipped(mf.sha256(ck.path)) if ck.path.is_file() else None
    return Datastore.index(load_corpus(found)) if found else None


def write(out: Path, res: dict) -> int:
    atomic.write_text(out / "gpu_check.json", json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


def profile(a, res: dict, ck, prompts: list[list[int]], cfg: GenerateConfig, eos, store, out: Path) -> int:
    """--profile: the forward's cost by tokens (engine call vs bare graph replay) and the store arm's ops, then
    plain and the store arm timed as in the full check (bench/gpu_profile.py)."""
    from .gpu_profile import forward_costs, op_tables

    low = DeviceEngine(ck.model, a.device, a.dtype)
    stage(f"forward costs by tokens, {a.dtype}")
    res["forward"] = forward_costs(low, ck.cfg.vocab_size)
    stage(f"forward: {res['forward']}")
    make = (lambda: StoreDrafter(NgramDrafter(4), store)) if store else (lambda: NgramDrafter(4))
    spec = SpecConfig.for_draft(STORE.name if store else NGRAM.name)
    plain = timed(low, prompts, cfg, eos)
    r = timed(low, prompts, cfg, eos, make, spec)
    res["plain"] = {k: v for k, v in plain.items() if k != "outputs"}
    res["spork"] = {spec.draft: {**{k: v for k, v in r.items() if k != "outputs"},
                                 "x_plain": round(r["tokens_per_s"] / plain["tokens_per_s"], 2),
                                 "mismatches": sum(x != y for x, y in zip(r["outputs"], plain["outputs"]))}}
    stage("torch.profiler over the first 2 prompts")
    res["profile"] = op_tables(lambda: timed(low, prompts[:2], cfg, eos, make, spec), out)
    return write(out, res)
