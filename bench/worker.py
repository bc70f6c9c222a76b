"""One arm on one prompt set, in its own process (so its peak resident memory is its own): JSONL records."""
from __future__ import annotations

import json
import platform
import resource
import sys
import time
from pathlib import Path

from spork_trt import atomic
from spork_trt.config import GenerateConfig
from spork_trt.errors import UserError
from spork_trt.io_spec import request_config
from spork_trt.loop.runtime import Runtime

from .arms import parse_arm
from .prompts import git_sha, load_prompts


def make_runner(arm, a):
    """(backend name, tokenizer, run(prompt ids, cfg, grammar) -> (token ids, Stats)) for an arm."""
    if arm.mode != "peer":
        rt = (Runtime.from_build(a.engines, a.dtype) if a.engines  # --dtype bf16 / int4: the CPU torch engine
              else Runtime.load(a.model, "cpu", a.dtype) if a.dtype != "fp32" else Runtime.load(a.model))
        return rt.backend, rt.tokenizer, lambda ids, cfg, grammar=None: (lambda r: (r.token_ids, r.stats))(
            rt.generate(ids, cfg, arm.mode, arm.spec, grammar=grammar))
    from spork_trt.loop.stats import Stats
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import load_checkpoint

    from .peers import PEERS

    if a.temperature != 0:
        raise UserError("peer arms are timed greedy only: use --temperature 0")
    if a.response_format:
        raise UserError(f"{arm.name} does not take --response-format here: constrained arms are plain and spork")
    source, cache = a.model, Path(".cache/peers")
    if a.engines:
        from spork_trt.checkpoint import manifest as mf

        source = mf.read(Path(a.engines))["source"]["path"]  # the checkpoint the engines were built from
        cache = Path(a.engines) / "peers"
    ck = load_checkpoint(source)
    tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
    peer = PEERS[arm.peer]
    generate = peer.load(ck, cache)

    def run(ids, cfg, grammar=None):
        out = generate(ids, cfg.max_new_tokens, tok.eos_ids)
        return out, Stats(steps=len(out), committed_tokens=len(out))

    return peer.backend, tok, run


def shard(text: str) -> tuple[int, int]:
    """"K/R" -> (K, R), 0 <= K < R."""
    try:
        k, rounds = (int(x) for x in text.split("/"))
    except ValueError:
        k, rounds = -1, 0
    if not 0 <= k < rounds:
        raise UserError(f"--shard {text!r}: write K/R with 0 <= K < R, e.g. 0/4")
    return k, rounds


def grammars(value: str | None, rows: list[dict]) -> list:
    """--response-format: None for every prompt; `json_schema`: each prompt's own schema (a set like json_extract
    carries one); otherwise KIND[:SOURCE] as `generate --grammar` takes it, the same for every prompt."""
    from spork_trt.cli.main import grammar_flag
    from spork_trt.spec.grammar import GrammarSpec

    if value != "json_schema":
        return [grammar_flag(value)] * len(rows)
    if not all("schema" in r for r in rows):
        raise UserError("--response-format json_schema without a FILE uses each prompt's own schema: take a prompt "
                        "set that has one (json_extract) or write json_schema:FILE")
    return [GrammarSpec("json_schema", r["schema"]) for r in rows]


def main(a) -> int:
    from tqdm import tqdm

    arm = parse_arm(a.arm)
    cfg = request_config({"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "seed": a.seed},
                         lambda f: f.flag)  # checked before any model loads
    backend, tokenizer, run = make_runner(arm, a)
    k, rounds = shard(a.shard)
    rows = load_prompts(a.prompts, a.limit)[k::rounds]
    common = {"git_sha": git_sha(), "machine": f"{platform.machine()} {platform.processor()}".strip(),
              "arm": arm.name, "backend": backend, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
              "temperature": a.temperature, "response_format": a.response_format or "",
              "spec": vars(arm.spec) if arm.mode in ("spork", "gate") else None}
    ids = [tokenizer.encode_prompt(r["prompt"]) for r in rows]
    specs = grammars(a.response_format, rows)
    run(ids[0], GenerateConfig(max_new_tokens=16, sampling=cfg.sampling), specs[0])  # warm-up (compiles its grammar)
    Path(a.out).unlink(missing_ok=True)  # a failed rerun leaves no earlier run's records to be read as its own
    with atomic.open(a.out) as fh:  # --out appears when complete: never a partial record file
        for r, p, g in tqdm(list(zip(rows, ids, specs)), desc=arm.name, file=sys.stderr, leave=False):
            t = time.perf_counter()
            token_ids, st = run(p, cfg, g)
            wall = time.perf_counter() - t
            fh.write(json.dumps({**common, "round": k, "prompt_id": r["id"], "category": r["category"],
                                 "prompt_tokens": len(p), "tokens": len(token_ids), "time_s": wall,
                                 "steps": st.steps, "draft_tokens": st.draft_tokens,
                                 "accepted_tokens": st.accepted_tokens, "committed_tokens": st.committed_tokens,
                                 "accepted_length_histogram": st.to_json()["accepted_length_histogram"],
                                 "propose_s": st.propose_s, "verify_s": st.verify_s, "fallbacks": st.fallbacks,
                                 "pruned_tokens": st.pruned_tokens, "score_s": st.score_s,
                                 "scored_steps": st.scored_steps, "verifier_offs": st.verifier_offs,
                                 "gated_tokens": st.gated_tokens, "grammar_s": st.grammar_s,
                                 "forced_tokens": st.forced_tokens,
                                 "token_ids": token_ids}) + "\n")
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        fh.write(json.dumps({**common, "peak_rss_mb": peak_mb}) + "\n")
    return 0
