"""Plain greedy decoding speed of our engines (torch; ONNX Runtime with --engines) vs transformers `generate`, and
the memory-bandwidth bound.

Both arms decode the same prompts for exactly `max_new_tokens` tokens (EOS ignored, so the token accounting is
identical), after one warm-up prompt; time is perf_counter around the whole request, prefill included.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spork_trt.config import GenerateConfig
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.loop.generate import generate
from spork_trt.checkpoint.tokenizer import load_tokenizer
from spork_trt.checkpoint.weights import Checkpoint, load_checkpoint

from .prompts import git_sha, load_prompts


@dataclass
class ArmResult:
    name: str
    tokens: int
    time_s: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.time_s


def read_bandwidth_gbs(n_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Median read bandwidth of a sum over a buffer far larger than the caches (GB/s), on this process's threads."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return n_bytes / sorted(times)[repeats // 2] / 1e9


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every matrix once (the embedding lookup reads one row only)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or name == "embed.weight" and not model.cfg.tie_embeddings:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def run_engine(name: str, engine, prompts: list[list[int]], n: int) -> ArmResult:
    cfg = GenerateConfig(max_new_tokens=n)
    generate(engine, prompts[0], cfg, frozenset())  # warm-up
    t = time.perf_counter()
    tokens = sum(len(generate(engine, p, cfg, frozenset()).token_ids) for p in prompts)
    return ArmResult(name, tokens, time.perf_counter() - t)


def run_transformers(ck: Checkpoint, eos_id: int, prompts: list[list[int]], n: int) -> ArmResult:
    from .peers import hf_generate, load_hf

    hf = load_hf(ck)
    eos = frozenset({eos_id})
    hf_generate(hf, prompts[0], n, eos, min_new=n)  # warm-up
    t = time.perf_counter()
    tokens = sum(len(hf_generate(hf, q, n, eos, min_new=n)) for q in prompts)
    return ArmResult("transformers generate", tokens, time.perf_counter() - t)


def main(args) -> int:
    ck = load_checkpoint(args.model)
    tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
    prompts = [tok.encode_prompt(r["prompt"]) for r in load_prompts(args.prompts, args.limit)]
    bw = read_bandwidth_gbs()
    wbytes = weight_bytes_per_token(ck.model)
    bound = bw * 1e9 / wbytes
    arms = [run_engine("spork_trt torch plain", TorchEngine(ck.model), prompts, args.max_new_tokens)]
    if args.engines:
        from spork_trt.engines import load_engine
        from spork_trt.checkpoint import manifest as mf

        m = mf.read(Path(args.engines))
        target = load_engine(Path(args.engines), m["engines"]["target"], ck.cfg)
        arms.append(run_engine(f"spork_trt {m['backend']} {m['engines']['target']['precision']} plain", target,
                               prompts, args.max_new_tokens))
    if not args.skip_transformers:
        arms.append(run_transformers(ck, tok.hf.eos_token_id, prompts, args.max_new_tokens))
    summary = {
        "git_sha": git_sha(), "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "prompts": args.prompts, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "read_bandwidth_gbs": round(bw, 2), "weight_mb_per_token": round(wbytes / 1e6, 1),
        "bandwidth_bound_tokens_per_second": round(bound, 2),
        "arms": [dict(asdict(a), tokens_per_second=round(a.tokens_per_second, 2),
                      fraction_of_bound=round(a.tokens_per_second / bound, 3)) for a in arms],
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"read bandwidth {bw:.1f} GB/s, {wbytes / 1e6:.0f} MB of weights per token -> bound {bound:.1f} tokens/s")
    print(f"{'arm':36} {'tokens':>7} {'time_s':>8} {'tokens/s':>9} {'of bound':>9}")
    for a in summary["arms"]:
        print(f"{a['name']:36} {a['tokens']:>7} {a['time_s']:>8.2f} {a['tokens_per_second']:>9.2f} "
              f"{a['fraction_of_bound']:>9.1%}")
    return 0
