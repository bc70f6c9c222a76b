"""One arm on one prompt set, in its own process (so its peak resident memory is its own): JSONL records."""
from __future__ import annotations

import json
import platform
import resource
import sys
import time

from spork_trt.config import GenerateConfig, SamplingConfig
from spork_trt.runtime import Runtime

from .arms import parse_arm
from .prompts import git_sha, load_prompts


def main(a) -> int:
    from tqdm import tqdm

    arm = parse_arm(a.arm)
    rt = Runtime.from_engines(a.engines) if a.engines else Runtime.load(a.model)
    rows = load_prompts(a.prompts, a.limit)
    cfg = GenerateConfig(max_new_tokens=a.max_new_tokens, sampling=SamplingConfig(temperature=a.temperature,
                                                                                  seed=a.seed))
    common = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "arm": arm.name, "backend": rt.backend, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
              "temperature": a.temperature, "spec": vars(arm.spec) if arm.mode == "spork" else None}
    ids = [rt.tokenizer.encode_prompt(r["prompt"]) for r in rows]
    rt.generate(ids[0], GenerateConfig(max_new_tokens=16, sampling=cfg.sampling), arm.mode, arm.spec)  # warm-up
    with open(a.out, "w") as fh:
        for r, p in tqdm(list(zip(rows, ids)), desc=arm.name, file=sys.stderr, leave=False):
            t = time.perf_counter()
            res = rt.generate(p, cfg, arm.mode, arm.spec)
            wall = time.perf_counter() - t
            st = res.stats
            fh.write(json.dumps({**common, "prompt_id": r["id"], "category": r["category"],
                                 "prompt_tokens": len(p), "tokens": len(res.token_ids), "time_s": wall,
                                 "steps": st.steps, "draft_tokens": st.draft_tokens,
                                 "accepted_tokens": st.accepted_tokens, "committed_tokens": st.committed_tokens,
                                 "accepted_length_histogram": st.to_json()["accepted_length_histogram"],
                                 "propose_s": st.propose_s, "verify_s": st.verify_s, "fallbacks": st.fallbacks,
                                 "pruned_tokens": st.pruned_tokens,
                                 "token_ids": res.token_ids}) + "\n")
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        fh.write(json.dumps({**common, "peak_rss_mb": peak_mb}) + "\n")
    return 0
