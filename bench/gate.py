"""`python -m bench gate`: the lossy gate mode's speed and fidelity as a function of tau, so a user can pick tau
knowingly. One `bench run` (plain, lossless spork and one gate arm per tau, same prompts), then gate.json and
gate.png (speedup vs plain and agreement with plain, per prompt set)."""
from __future__ import annotations

import json
from pathlib import Path

from spork_trt import atomic
from spork_trt.errors import UserError

from .run import command, run_arms, summarize


def sweep_points(summary: dict) -> dict[str, list[dict]]:
    """prompt set -> [{"tau", ...}] ascending tau, from a summary holding gate/DRAFT/TAU arms."""
    out: dict[str, list[dict]] = {}
    for arm in summary["arms"]:
        if arm["name"].startswith("gate/"):
            out.setdefault(arm["prompts"], []).append({
                "tau": float(arm["name"].rsplit("/", 1)[1]), "tokens_per_second": arm["tokens_per_second"],
                "speedup_vs_plain": arm["speedup_vs_plain"], "exact_match_rate": arm.get("exact_match_rate"),
                "token_agreement": arm.get("token_agreement"), "rouge_l": arm.get("rouge_l"),
                "gated_fraction": round(arm["gated_tokens"] / max(1, arm["tokens"]), 4)})
    return {k: sorted(v, key=lambda p: p["tau"]) for k, v in out.items()}


def table(points: dict[str, list[dict]]) -> str:
    lines = ["| prompts | tau | speedup vs plain | token agreement | exact match | ROUGE-L | gated tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for prompts, pts in points.items():
        lines += [f"| {prompts} | {p['tau']:g} | {p['speedup_vs_plain']:.2f}x | {p['token_agreement']:.2f} | "
                  f"{p['exact_match_rate']:.2f} | {p['rouge_l']:.2f} | {p['gated_fraction']:.0%} |" for p in pts]
    return "\n".join(lines)


def plot(points: dict[str, list[dict]], lossless: dict[str, float], path: Path) -> Path:
    from .report import finish, plt

    fig, (ax1, ax2) = plt().subplots(1, 2, figsize=(10, 4))
    for prompts, pts in points.items():
        taus = [p["tau"] for p in pts]
        line = ax1.plot(taus, [p["speedup_vs_plain"] for p in pts], "o-", label=f"gate, {prompts}")[0]
        if prompts in lossless:
            ax1.axhline(lossless[prompts], color=line.get_color(), ls=":", label=f"lossless spork, {prompts}")
        ax2.plot(taus, [p["token_agreement"] for p in pts], "o-", color=line.get_color(),
                 label=f"token agreement, {prompts}")
        ax2.plot(taus, [p["exact_match_rate"] for p in pts], "s--", color=line.get_color(),
                 label=f"exact match, {prompts}")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set(xlabel="tau (path confidence the verifier alone accepts)", ylabel="speedup vs plain (tokens/s)")
    ax2.set(xlabel="tau", ylabel="agreement with plain greedy", ylim=(0, 1.05))
    return finish(fig, [ax1, ax2], path, 7)


def main(a) -> int:
    try:
        taus = [float(t) for t in a.taus.split(",")]
    except ValueError:
        raise UserError(f"--taus must be a comma list of numbers in (0, 1], got {a.taus!r}") from None
    if not taus or not all(0 < t <= 1 for t in taus):
        raise UserError(f"--taus must be in (0, 1], got {a.taus!r}")
    a.arms = ["plain", f"spork/{a.draft}", *[f"gate/{a.draft}/{t:g}" for t in taus]]
    out = Path(a.out)
    summary = summarize(run_arms(a))
    points = sweep_points(summary)
    lossless = {x["prompts"]: x["speedup_vs_plain"] for x in summary["arms"] if x["name"] == f"spork/{a.draft}"}
    result = {"draft": a.draft, "lossless_speedup": lossless, "points": points,
              "git_sha": summary["arms"][0]["git_sha"], "machine": summary["arms"][0]["machine"],
              "command": command()}
    atomic.write_text(out / "gate.json", json.dumps(result, indent=1))
    png = plot(points, lossless, out / "gate.png")
    if a.json:
        print(json.dumps(result))
        return 0
    print(table(points))
    print(f"lossless spork/{a.draft}: " + ", ".join(f"{k} {v:.2f}x" for k, v in lossless.items()) + f"; plot {png}")
    return 0
