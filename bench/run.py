"""`python -m bench run`: every arm on every prompt set, each arm in its own process, then a summary.

Same prompts, same token accounting and the same stop rule for every arm; one warm-up request per arm, excluded;
time is perf_counter around each whole request (prefill included). Lossless arms are checked token for token
against plain (greedy runs); any mismatch is reported loudly and counted.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from spork_trt import atomic
from spork_trt.errors import UserError

from .arms import parse_arm
from .prompts import load_prompts


def run_arms(a) -> list[Path]:
    """Each prompt set in `a.rounds` rounds (round k: prompts k, k + R, k + 2R, ...), every arm on a round's prompts
    before the next round starts (the arms' order rotated each round), so a machine that speeds up or slows down
    during the run moves every arm alike: the speedups are paired in time, not one arm's minutes against another's."""
    if a.rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {a.rounds}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for prompts in a.prompts.split(","):
        rounds = max(1, min(a.rounds, len(load_prompts(prompts, a.limit))))
        planned = {arm: [out / record_file(prompts, arm, k, rounds) for k in range(rounds)] for arm in a.arms}
        clear_stale(out, prompts, planned)
        for k in range(rounds):
            for arm in a.arms[k % len(a.arms):] + a.arms[:k % len(a.arms)]:
                print(f"[bench] {prompts} / {arm}" + (f" (round {k + 1} of {rounds})" if rounds > 1 else ""),
                      file=sys.stderr, flush=True)
                cmd = worker_command(a, prompts, arm, planned[arm][k], f"{k}/{rounds}")
                if subprocess.run(cmd, preexec_fn=die_with_parent).returncode != 0:
                    raise UserError(f"arm {arm} on {prompts} failed (its message is above); the records of the "
                                    f"arms before it are in {out}")
                files.append(planned[arm][k])
    return files


def worker_command(a, prompts: str, arm: str, out: Path, shard: str) -> list[str]:
    cmd = [sys.executable, "-m", "bench", "worker", "--arm", arm, "--prompts", prompts, "--max-new-tokens",
           str(a.max_new_tokens), "--temperature", str(a.temperature), "--out", str(out), "--shard", shard]
    cmd += ["--limit", str(a.limit)] if a.limit else []
    cmd += ["--model", a.model] if a.model else []
    cmd += ["--engines", a.engines] if a.engines else []
    cmd += ["--seed", str(a.seed)] if a.seed is not None else []
    cmd += ["--dtype", a.dtype] if a.dtype != "fp32" else []
    cmd += ["--response-format", a.response_format] if a.response_format else []
    return cmd


def clear_stale(out: Path, prompts: str, planned: dict[str, list[Path]]) -> None:
    """Remove an earlier run's records of these arms in rounds this run does not write (another --rounds), so
    `bench report`, which reads every JSONL in the folder, never mixes them with this run's."""
    for arm, files in planned.items():
        stem = record_file(prompts, arm, 0, 1)[:-len(".jsonl")]
        for old in out.iterdir():
            if re.fullmatch(re.escape(stem) + r"(\.r\d+)?\.jsonl", old.name) and old not in files:
                old.unlink()


def record_file(prompts: str, arm: str, k: int, rounds: int) -> str:
    """The JSONL name of one arm's records of round k (one round: no suffix)."""
    stem = f"{Path(prompts).stem}__{arm.replace('/', '_').replace(':', '-')}"
    return f"{stem}.r{k}.jsonl" if rounds > 1 else f"{stem}.jsonl"


def die_with_parent() -> None:
    """A worker's preexec_fn: it gets SIGTERM when `bench run` dies (Linux PR_SET_PDEATHSIG), so a killed run leaves
    no worker behind still writing the records a rerun writes."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def summarize(files: list[Path]) -> dict:
    records = defaultdict(list)  # (prompts, arm) -> per-prompt records
    peaks = {}
    for f in files:
        for line in f.read_text().splitlines():
            r = json.loads(line)
            key = (r["prompts"], r["arm"])
            if "peak_rss_mb" in r:  # one per worker: the arm's peak over its rounds
                peaks[key] = max(peaks.get(key, 0.0), r["peak_rss_mb"])
            else:
                records[key].append(r)
    arms = []
    for (prompts, arm), rows in records.items():
        plain = {r["prompt_id"]: r for r in records.get((prompts, "plain"), [])}
        tps = sum(r["tokens"] for r in rows) / sum(r["time_s"] for r in rows)
        plain_tps = (sum(r["tokens"] for r in plain.values()) / sum(r["time_s"] for r in plain.values())
                     if plain else None)
        greedy, lossy = rows[0]["temperature"] == 0, arm.startswith(("peer/", "gate/"))
        pairs = [(r["token_ids"], plain[r["prompt_id"]]["token_ids"]) for r in rows
                 if greedy and r["prompt_id"] in plain]
        differs = sum(1 for ours, ref in pairs if ours != ref)
        mismatches = None if lossy else differs  # a peer or gate mode: reported, not a lossless failure
        if mismatches:
            print(f"[bench] LOSSLESS MISMATCH: {arm} differs from plain on {mismatches} {prompts} prompts",
                  file=sys.stderr)
        cats = defaultdict(lambda: [0, 0.0])
        for r in rows:
            cats[r["category"]][0] += r["tokens"]
            cats[r["category"]][1] += r["time_s"]
        drafted = sum(r["draft_tokens"] for r in rows)
        arms.append({
            "name": arm, "prompts": prompts, "n_prompts": len(rows), "tokens": sum(r["tokens"] for r in rows),
            "tokens_per_second": round(tps, 3),
            "speedup_vs_plain": round(tps / plain_tps, 3) if plain_tps else None,
            "speedup_by_round": by_round(rows, list(plain.values())) if plain else [],
            "acceptance_rate": round(sum(r["accepted_tokens"] for r in rows) / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round(sum(r["committed_tokens"] for r in rows) /
                                          max(1, sum(r["steps"] for r in rows)), 3),
            "pruned_fraction": round(sum(r.get("pruned_tokens", 0) for r in rows) /
                                     max(1, drafted + sum(r.get("pruned_tokens", 0) for r in rows)), 3),
            "lossless_mismatches": mismatches, "differs_from_plain": differs,
            "draft_tokens": drafted, "verifier_offs": sum(r.get("verifier_offs", 0) for r in rows),
            "scored_steps": sum(r.get("scored_steps", 0) for r in rows),
            "gated_tokens": sum(r.get("gated_tokens", 0) for r in rows), **agreement(pairs),
            "response_format": rows[0].get("response_format", ""),
            "forced_tokens": sum(r.get("forced_tokens", 0) for r in rows),
            "grammar_ms_per_token": round(1000 * sum(r.get("grammar_s", 0.0) for r in rows) /
                                          max(1, sum(r["tokens"] for r in rows)), 4),
            "peak_rss_mb": round(peaks.get((prompts, arm), 0.0), 1),
            "per_category_tokens_per_second": {c: round(t / s, 3) for c, (t, s) in sorted(cats.items())},
            "backend": rows[0]["backend"], "git_sha": rows[0]["git_sha"], "machine": rows[0]["machine"],
            "temperature": rows[0]["temperature"],
            "max_new_tokens": rows[0]["max_new_tokens"],
        })
    return {"arms": arms}


def by_round(rows: list[dict], plain: list[dict]) -> list[float]:
    """The arm's tokens/s over plain's in each round of the run (records before rounds existed: round 0): how much
    the speedup moved while the run went on."""
    def tps(rs: list[dict]) -> dict[int, float]:
        acc = defaultdict(lambda: [0, 0.0])
        for r in rs:
            acc[r.get("round", 0)][0] += r["tokens"]
            acc[r.get("round", 0)][1] += r["time_s"]
        return {k: t / s for k, (t, s) in acc.items() if s > 0}

    ours, ref = tps(rows), tps(plain)
    return [round(ours[k] / ref[k], 3) for k in sorted(ours) if k in ref]


def command() -> str:
    """The command line that produced a result file, as a user would type it."""
    import shlex

    return "python -m bench " + " ".join(shlex.quote(x) for x in sys.argv[1:])


def agreement(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Fidelity against plain (greedy): exact-match rate, token agreement (the share of plain's tokens produced
    before the first divergence), ROUGE-L F1 over token ids; means over prompts."""
    if not pairs:
        return {}
    n = len(pairs)
    return {"exact_match_rate": round(sum(a == b for a, b in pairs) / n, 4),
            "token_agreement": round(sum(common_prefix(a, b) / max(1, len(b)) for a, b in pairs) / n, 4),
            "rouge_l": round(sum(rouge_l(a, b) for a, b in pairs) / n, 4)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1: longest common subsequence against both lengths."""
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def table(summary: dict) -> str:
    lines = ["| prompts | backend | arm | tokens/s | speedup vs plain (rounds: min-max) | acceptance | mean accepted "
             "length | mismatches | peak RSS MB |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in summary["arms"]:
        sp = "-" if a["speedup_vs_plain"] is None else f"{a['speedup_vs_plain']:.2f}x"
        rs = a.get("speedup_by_round") or []
        sp += f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 and a["name"] != "plain" else ""
        mm = a["lossless_mismatches"]
        mm = f"({a['differs_from_plain']} differ)" if mm is None else mm
        lines.append(f"| {a['prompts']} | {a['backend']} | {a['name']} | {a['tokens_per_second']:.2f} | {sp} | "
                     f"{a['acceptance_rate']:.2f} | {a['mean_accepted_length']:.2f} | {mm} | "
                     f"{a['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main(a) -> int:
    for arm in a.arms:
        parse_arm(arm)  # fail before any work
    if "plain" not in a.arms:
        a.arms = ["plain"] + a.arms  # every speedup is measured against plain in the same run
    files = run_arms(a)
    summary = {**summarize(files), "command": command()}
    atomic.write_text(Path(a.out) / "summary.json", json.dumps(summary, indent=1))
    atomic.write_text(Path(a.out) / "summary.md", table(summary) + "\n")
    print(json.dumps(summary) if a.json else table(summary))
    return 1 if any(x["lossless_mismatches"] for x in summary["arms"]) else 0  # None (peers) is falsy
