"""`python -m bench fidelity`: how closely each build's target follows the fp32 reference, teacher-forced on held-out
text (Python standard-library sources: never a benchmark prompt, never a datastore, head or calibration text):
per token, top-1 agreement with the reference's argmax, KL(reference || target) in nats (mean and p99), and each
one's perplexity on the text itself. One forward per chunk (every row through the multi-row kernels)."""
from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.config import CPU_TORCH_DTYPES
from spork_trt.engines import chain_input, load_engine
from spork_trt.errors import UserError

from . import torch_lever
from .prompts import git_sha

# held-out text: modules whose functions the INT8 static calibration does not draw on (export/code_prompts.py)
MODULES = ("argparse", "textwrap", "difflib", "csv", "configparser", "gettext", "fractions", "shlex")


@dataclass(frozen=True)
class Fidelity:
    build: str
    precision: str
    tokens: int
    top1: float  # share of positions whose argmax equals the reference's
    kl_mean: float  # nats
    kl_p99: float
    perplexity: float  # on the text itself
    reference_perplexity: float


def held_out(tok, chunks: int, tokens: int) -> list[list[int]]:
    """`chunks` runs of `tokens` token ids from the standard-library sources in MODULES, in turn."""
    out = []
    for name in MODULES:
        ids = tok.encode_prompt(inspect.getsource(importlib.import_module(name)), raw=True)
        out += [ids[i:i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)][:max(1, chunks // len(MODULES))]
    return out[:chunks]


def logits(engine, ids: list[int]) -> torch.Tensor:
    """[T, V] teacher-forced over one chunk, in a fresh slot."""
    return engine.forward_batch([chain_input(engine.make_pool(1, len(ids) + 2).caches[0], ids)])[0]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], texts: list[list[int]]) -> tuple[float, ...]:
    agree, kls, nll, ref_nll = [], [], [], []
    for r, g, ids in zip(ref, got, texts):
        lr, lg = torch.log_softmax(r.double(), -1), torch.log_softmax(g.double(), -1)  # [T, V]
        agree.append((r.argmax(-1) == g.argmax(-1)).double())
        kls.append((lr.exp() * (lr - lg)).sum(-1).clamp_min(0))
        nxt = torch.tensor(ids[1:])
        nll.append(-lg[torch.arange(len(ids) - 1), nxt])
        ref_nll.append(-lr[torch.arange(len(ids) - 1), nxt])
    kl = torch.cat(kls)
    return (float(torch.cat(agree).mean()), float(kl.mean()), float(kl.quantile(0.99)),
            float(torch.cat(nll).mean().exp()), float(torch.cat(ref_nll).mean().exp()))


def target_of(build: Path) -> tuple[object, str, object]:
    """(manifest, target precision, model config) of a build."""
    m = mf.read(build)
    return m, m["engines"]["target"]["precision"], mf.spec_config(m["model"])


def main(a) -> int:
    from spork_trt.checkpoint.tokenizer import load_tokenizer

    builds = [Path(b) for b in a.builds]
    dtypes = torch_lever.parse_dtypes(a.torch)
    ref_build = Path(a.reference)
    rm, precision, cfg = target_of(ref_build)
    if precision != "fp32":
        raise UserError(f"--reference {ref_build} has a {precision} target: give a build whose target is fp32 "
                        "(`python -m export build`)")
    tok = load_tokenizer(ref_build, "hf", cfg.eos_token_ids)
    texts = held_out(tok, a.chunks, a.tokens)
    ref_engine = load_engine(ref_build, rm["engines"]["target"], cfg, target=True)
    ref = [logits(ref_engine, ids) for ids in texts]
    rows = []
    for b in builds:
        m, p, c = target_of(b)
        if m["source"]["sha256"] != rm["source"]["sha256"]:
            raise UserError(f"{b} was built from another checkpoint than --reference {ref_build}")
        engine = load_engine(b, m["engines"]["target"], c, target=True)
        top1, kl, p99, ppl, ref_ppl = compare(ref, [logits(engine, ids) for ids in texts], texts)
        rows.append(Fidelity(str(b), p + (" (checkpoint blocks)" if m["engines"]["target"].get("weights") else ""),
                             sum(len(t) for t in texts), top1, kl, p99, ppl, ref_ppl))
    for d in torch_lever.parse_dtypes(a.cpu_torch, CPU_TORCH_DTYPES, "--cpu-torch"):  # the reference build's checkpoint on the CPU torch engine (served targets)
        from spork_trt.engines.cpu.engine import cpu_target
        from spork_trt.loop.runtime import source_checkpoint

        engine = cpu_target(source_checkpoint(rm), d)
        top1, kl, p99, ppl, ref_ppl = compare(ref, [logits(engine, ids) for ids in texts], texts)
        rows.append(Fidelity(f"cpu torch {d}", f"{d} (CPU torch engine)", sum(len(t) for t in texts), top1, kl, p99,
                             ppl, ref_ppl))
    for d in dtypes:  # the torch lever (bench/torch_lever.py): the reference model in another dtype, eager
        model = torch_lever.reference_model(ref_build, d)
        top1, kl, p99, ppl, ref_ppl = compare(ref, [torch_lever.teacher_forced(model, ids) for ids in texts], texts)
        rows.append(Fidelity(f"torch {d}", f"{d} (reference model)", sum(len(t) for t in texts), top1, kl, p99, ppl,
                             ref_ppl))
    table = ["| build | target | tokens | top-1 vs fp32 | mean KL (nats) | p99 KL | perplexity (fp32) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r.build} | {r.precision} | {r.tokens} | {r.top1:.4f} | {r.kl_mean:.4f} | {r.kl_p99:.4f} | "
              f"{r.perplexity:.3f} ({r.reference_perplexity:.3f}) |" for r in rows]
    summary = {"git_sha": git_sha(), "machine": platform.machine(), "reference": str(ref_build), "modules": MODULES,
               "rows": [asdict(r) for r in rows]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "fidelity.json", json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary) if a.json else "\n".join(table))
    print(f"[bench] {len(texts)} chunks of {a.tokens} tokens from {', '.join(MODULES)}; {out / 'fidelity.json'}",
          file=sys.stderr)
    return 0
