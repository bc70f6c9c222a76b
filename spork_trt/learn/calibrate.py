"""`python -m export calibrate`: fit the verifier's confidence head on the target's real verdicts.

1. Collect: run the lossless loop (fixed tree shape, so every drafted node is verified) on real prompts with the
   verifier scoring every speculative step; every draft node whose parent the target accepted is a fair test of
   P(node accepted | parent accepted): its features and the target's verdict become one labelled example.
   Collected nodes are cached as .npz (plain arrays, loaded without pickle) beside the engines.
2. Fit the logistic head (verifier.fit_head) on one prompt set; 3. report on a held-out set per depth: ECE
   (10 equal-width bins), AUROC, Brier, counts, and a reliability-diagram PNG; 4. save the head beside the engines.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.draft_kinds import AUTO_DRAFT
from spork_trt.errors import UserError
from spork_trt.loop.generate import generate
from spork_trt.prompts import load_prompts
from spork_trt.spec.verifier import FEATURES, ConfidenceHead, Verifier, fit_head, head_file

DEPTHS = range(1, 7)
BINS = 10


@dataclass(frozen=True)
class CalibrateConfig:
    engines: Path = Path("engines/default")
    prompts: str = "mt_bench"  # fitted on
    heldout: str | None = None  # reported on (default: the other built-in set)
    limit: int | None = None  # prompts per set (None: all, 80 MT-bench and 164 HumanEval; about 15 minutes here)
    max_new_tokens: int = 128
    draft: str = AUTO_DRAFT  # the drafter whose trees are scored (auto: the runtime's default); the head is for it
    tree_depth: int | None = None  # draft depth while collecting (default: the drafter's own shape)
    plot: Path | None = None  # default: ENGINES/calibration/reliability-<drafter>.png

    def spec(self) -> SpecConfig:
        """A fixed tree shape (so every drafted node is verified and labelled): the drafter's own, or its width at
        `tree_depth` with room for every depth."""
        if self.tree_depth is None:
            return SpecConfig.for_draft(self.draft, adaptive=False, verifier="on")
        base = SpecConfig.for_draft(self.draft)
        return SpecConfig.for_draft(self.draft, depth=self.tree_depth, adaptive=False, verifier="on",
                                    budget=max(base.tree_budget, base.tree_width * self.tree_depth))


@dataclass(frozen=True)
class NodeSet:
    x: np.ndarray  # [N, F] features
    y: np.ndarray  # [N] 1.0 when the target accepted the node
    depth: np.ndarray  # [N]
    n_prompts: int  # prompts they came from


@dataclass(frozen=True)
class CalibrationReport:
    head: ConfidenceHead
    per_depth: list[dict]  # [{"depth", "n", "ece", "auroc", "brier"}] on the held-out set
    heldout: str
    plot: Path
    head_path: Path

    def to_json(self) -> dict:
        return {"per_depth": self.per_depth, "heldout": self.heldout, "fitted_on": self.head.meta["fitted_on"],
                "head": str(self.head_path), "plot": str(self.plot)}


def log(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def collect(rt, prompts: str, cfg: CalibrateConfig, verifier: Verifier) -> NodeSet:
    """Labelled draft nodes from running the lossless loop on `prompts` (cached per set, drafter, tree shape and
    engines)."""
    from tqdm import tqdm

    spec, rows = cfg.spec(), load_prompts(prompts, cfg.limit)
    shape = f"{spec.tree_width}x{spec.tree_depth}x{spec.tree_budget}"
    key = f"{prompts}|{cfg.draft}|{shape}|{len(rows)}|{cfg.max_new_tokens}|{rt.verifier_layers}|{','.join(FEATURES)}"
    digest = hashlib.sha256((key + engines_sha(cfg.engines)).encode()).hexdigest()[:16]
    cache = cfg.engines / "calibration" / f"nodes-{Path(prompts).stem}-{digest}.npz"
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            log(f"{prompts}: {len(z['y'])} labelled nodes from {cache}")
            return NodeSet(z["x"], z["y"], z["depth"], len(rows))
    xs, ys, ds = [], [], []

    gen_cfg = GenerateConfig(max_new_tokens=cfg.max_new_tokens)
    for r in tqdm(rows, desc=f"calibrate {prompts}", file=sys.stderr, leave=False):
        ids = rt.tokenizer.encode_prompt(r["prompt"])
        out = generate(rt.engine, ids, gen_cfg, rt.tokenizer.eos_ids,
                       drafter=rt.drafter(cfg.draft, gen_cfg.sampling), spec=spec, verifier=verifier, record=True)
        for step in out.verified:
            if step.scored is None:
                continue  # a plain step (recovery): nothing drafted
            on_path = set(step.verdict.path)
            for i in range(1, len(step.tree)):
                if step.tree.parents[i] in on_path:
                    xs.append(step.scored.features[i])
                    ys.append(float(i in on_path))
                    ds.append(step.scored.depth[i])
    if not ys:
        raise UserError(f"the {cfg.draft} drafter proposed nothing on {prompts}: calibrate with more prompts")
    nodes = NodeSet(np.array(xs), np.array(ys), np.array(ds), len(rows))
    cache.parent.mkdir(parents=True, exist_ok=True)
    with atomic.open(cache, "wb") as fh:
        np.savez(fh, x=nodes.x, y=nodes.y, depth=nodes.depth)
    log(f"{prompts}: {len(ys)} labelled nodes ({int(nodes.y.sum())} accepted), cached in {cache}")
    return nodes


def engines_sha(engines: Path) -> str:
    """The build's verifier + target identity (a rebuilt engine invalidates collected nodes)."""
    from spork_trt.checkpoint import manifest as mf

    m = mf.read(engines)
    return "".join(mf.weights(m, m["engines"][r]).get("sha256", "") for r in ("target", "verifier"))


def ece(p: np.ndarray, y: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error: bin-weighted |mean confidence - accepted fraction| over equal-width bins."""
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return float(sum(abs(p[idx == b].mean() - y[idx == b].mean()) * (idx == b).mean()
                     for b in range(bins) if (idx == b).any()))


def ece_floor(p: np.ndarray, draws: int = 200, bins: int = BINS) -> float:
    """The ECE a perfectly calibrated head would still show on this many nodes: the mean ECE of `draws` label sets
    drawn with P(accepted) = p exactly (seeded, so reports are reproducible). ECE near it is sampling noise; a few
    hundred nodes per depth put it at 0.04-0.06."""
    rng = np.random.default_rng(0)
    return float(np.mean([ece(p, (rng.random(len(p)) < p).astype(float), bins) for _ in range(draws)]))


def auroc(p: np.ndarray, y: np.ndarray) -> float | None:
    """Probability that an accepted node scores above a rejected one (ties count half); None without both."""
    pos, neg = int(y.sum()), int(len(y) - y.sum())
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(p, kind="mergesort")
    ranks = np.empty(len(p))
    sp = p[order]
    i = 0
    while i < len(p):  # average ranks over ties
        j = i
        while j + 1 < len(p) and sp[j + 1] == sp[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def per_depth(head: ConfidenceHead, nodes: NodeSet) -> list[dict]:
    p = head(nodes.x)
    out = []
    for d in DEPTHS:
        sel = nodes.depth == d if d < DEPTHS[-1] else nodes.depth >= d
        if not sel.any():
            continue
        a = auroc(p[sel], nodes.y[sel])
        out.append({"depth": d, "n": int(sel.sum()), "accepted": int(nodes.y[sel].sum()),
                    "ece": round(ece(p[sel], nodes.y[sel]), 4), "ece_floor": round(ece_floor(p[sel]), 4),
                    "auroc": None if a is None else round(a, 4),
                    "brier": round(float(((p[sel] - nodes.y[sel]) ** 2).mean()), 4)})
    return out


def reliability_plot(head: ConfidenceHead, nodes: NodeSet, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = head(nodes.x)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], "k:", lw=1, label="perfectly calibrated")
    for d in range(1, 5):
        sel = nodes.depth == d
        idx = np.minimum((p[sel] * BINS).astype(int), BINS - 1)
        pts = [(p[sel][idx == b].mean(), nodes.y[sel][idx == b].mean(), (idx == b).sum())
               for b in range(BINS) if (idx == b).sum() >= 5]
        if pts:
            xs, ys, _ = zip(*pts)
            ax.plot(xs, ys, "o-", label=f"depth {d} (n={int(sel.sum())})", ms=4)
    ax.set(xlabel="predicted P(accepted | parent accepted)", ylabel="accepted fraction", xlim=(0, 1), ylim=(0, 1),
           title=title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.open(path, "wb") as fh:
        fig.savefig(fh, format=path.suffix[1:] or "png", dpi=110)
    plt.close(fig)
    return path


def calibrate(cfg: CalibrateConfig) -> CalibrationReport:
    from spork_trt.loop.runtime import Runtime

    heldout = cfg.heldout or {"mt_bench": "humaneval", "humaneval": "mt_bench"}.get(cfg.prompts)
    if heldout is None:
        raise UserError(f"--prompts {cfg.prompts} is a file: name a held-out set with --heldout")
    if heldout == cfg.prompts:
        raise UserError("--heldout must differ from --prompts: metrics on the fitting prompts say little")
    rt = Runtime.from_engines(cfg.engines, load_head=False)  # an old head may be stale: it is being replaced
    cfg = replace(cfg, draft=rt.resolve_draft(cfg.draft))  # auto: store or ngram, as generate
    verifier = rt.verifier()  # headless: the runtime was loaded without one
    log(f"{rt.verifier_layers}-layer verifier, {cfg.draft} drafter, {cfg.limit or 'all'} prompts x "
        f"{cfg.max_new_tokens} tokens per set")
    fit_nodes = collect(rt, cfg.prompts, cfg, verifier)
    test_nodes = collect(rt, heldout, cfg, verifier)
    fitted_on = f"{cfg.prompts} ({fit_nodes.n_prompts} prompts x {cfg.max_new_tokens} tokens, {cfg.draft} drafter)"
    head = fit_head(fit_nodes.x, fit_nodes.y, rt.verifier_layers, meta={"fitted_on": fitted_on, "draft": cfg.draft})
    metrics = per_depth(head, test_nodes)
    head = ConfidenceHead(head.weights, head.bias, head.mean, head.scale, head.verifier_layers,
                          {**head.meta, "heldout": heldout, "per_depth": metrics})
    tag = head_file(cfg.draft).removeprefix("confidence_head").removesuffix(".json")  # "-ngram", "-self-int8", ...
    plot = cfg.plot or cfg.engines / "calibration" / f"reliability{tag}.png"
    reliability_plot(head, test_nodes, f"fit on {cfg.prompts}, held out: {heldout}", plot)
    head_path = head.save(cfg.engines / head_file(cfg.draft))
    log(f"saved {head_path}; reliability diagram {plot}")
    return CalibrationReport(head, metrics, heldout, plot, head_path)


def table(report: CalibrationReport) -> str:
    lines = [f"held out: {report.heldout}; fitted on {report.head.meta['fitted_on']}",
             "depth      n  accepted    ECE  (floor)  AUROC  Brier"]
    for m in report.per_depth:
        auc = "-" if m["auroc"] is None else f"{m['auroc']:.3f}"
        lines.append(f"{m['depth']:5d} {m['n']:6d} {m['accepted']:9d} {m['ece']:6.3f}  ({m['ece_floor']:.3f})"
                     f" {auc:>6} {m['brier']:6.3f}")
    lines.append("(floor: the ECE a perfectly calibrated head would show on this many nodes, from sampling alone)")
    return "\n".join(lines)
