"""`python -m bench replay`: the drafters that need no model (n-gram, the store) replayed over the target's own greedy
answers that a `bench run` recorded (its plain arm's token ids), with the engine core's scheduler and allotment and
a given cost curve of the target forward. What each drafter, tree shape and store size would commit per step, and
the speedup that cost curve would give: seconds of CPU, no target forward. An estimate that says what is worth
measuring (a GPU's cost curve on this CPU, a store of another size); speedups are measured by `bench run`.

No target is needed to verify: the answer is the target's greedy output, so a node is accepted iff its parent is
and its token is the answer's next one, what verify_greedy concludes from the target's logits. The first token
comes from the prefill in both arms (free here); the stop rule cuts a step that runs past the answer's end."""
from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spork_trt.config import SpecConfig
from spork_trt.spec.cost_model import PRIOR_SLOPE, CostModel
from spork_trt.spec.datastore import SEP, Datastore
from spork_trt.draft_kinds import NGRAM, STORE, is_kind
from spork_trt.spec.drafters import NgramDrafter, StoreDrafter
from spork_trt.errors import UserError
from spork_trt.spec.scheduler import Scheduler, allot
from spork_trt.spec.tree import DraftTree
from spork_trt.spec.verification import Verdict

DRAFTS = (NGRAM, STORE)  # the drafters that need no model
Cost = Callable[[int], float]  # a target forward of n tokens, in one-token forwards


@dataclass(frozen=True)
class Replayed:
    steps: int
    tokens: int  # committed, the prefill's first token excluded
    nodes: int  # draft nodes verified
    cost: float  # in one-token forwards

    def __add__(self, o: Replayed) -> Replayed:
        return Replayed(self.steps + o.steps, self.tokens + o.tokens, self.nodes + o.nodes, self.cost + o.cost)


def cost_curve(text: str | None) -> Cost:
    """"N:S,N:S,..." (seconds, or any unit, of a forward of N tokens; the first N must be 1) -> piecewise-linear
    cost relative to one token, the last slope beyond the last point; None: the scheduler's prior (cost_model)."""
    if not text:
        return CostModel().seconds  # no points measured: the prior itself
    try:
        pts = sorted((int(n), float(s)) for n, s in (x.split(":") for x in text.split(",")))
    except ValueError:
        pts = []
    if not pts or pts[0][0] != 1 or len(pts) < 2 or any(s <= 0 for _, s in pts):
        raise UserError(f"--costs {text!r}: write N:S pairs from N=1 with positive S, e.g. 1:2.2,16:3.0,64:3.1")
    base = pts[0][1]

    def cost(n: int) -> float:
        i = next((j for j in range(1, len(pts)) if n <= pts[j][0]), len(pts) - 1)
        (a, sa), (b, sb) = pts[i - 1], pts[i]
        return (sa + (sb - sa) * (n - a) / (b - a)) / base

    return cost


def replay(drafter, spec: SpecConfig, prompt: list[int], answer: list[int], cost: Cost) -> Replayed:
    """One request: a fresh scheduler (as `bench run`'s one-request core) whose cost model has measured `cost`."""
    costs = CostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        costs.record(n, cost(n))
    sched = Scheduler(spec, greedy=True, costs=costs, odds={})
    drafter.reset(list(prompt), len(prompt) + len(answer) + spec.tree_depth + 1)
    done, total = 1, Replayed(0, 0, 0, 0.0)
    while done < len(answer):
        speculating = sched.speculate()
        tree = drafter.propose(answer[done - 1], sched.shape()) if speculating else DraftTree.root_only(
            answer[done - 1])
        cands = sched.candidates(tree, True)
        keep = cands.keep(allot([cands], costs.seconds)[0])
        sub = tree.subtree(keep)
        path = [0]
        for k in range(done, len(answer)):  # follow the answer down the verified tree
            nxt = next((i for i in range(1, len(sub)) if sub.parents[i] == path[-1] and sub.tokens[i] == answer[k]),
                       None)
            if nxt is None:
                break
            path.append(nxt)
        accepted = len(path) - 1
        bonus = answer[done + accepted] if done + accepted < len(answer) else answer[-1]
        verdict = Verdict(tuple(path), tuple(answer[done:done + accepted]), bonus)
        drafter.commit(tree, verdict.renumber(keep))
        sched.record(sub, verdict, speculating, 0.0, cost(len(sub)), None, tree)
        step = min(accepted + 1, len(answer) - done)
        total += Replayed(1, step, len(sub) - 1, cost(len(sub)))
        done += step
    return total


def answers(run: Path, prompt_set: str) -> list[tuple[str, list[int]]]:
    """(prompt id, token ids) of the run's plain arm on `prompt_set`, in prompt order."""
    from .prompts import load_prompts

    got = {}
    for f in sorted(run.glob(f"{prompt_set}__plain*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if "token_ids" in r:
                got[str(r["prompt_id"])] = r["token_ids"]
    rows = [r for r in load_prompts(prompt_set, None) if str(r["id"]) in got]
    if not rows:
        raise UserError(f"{run} has no plain records of {prompt_set}: run `python -m bench run --prompts {prompt_set} "
                        f"--out {run}` first (its plain arm records the target's answers)")
    return [(r["prompt"], got[str(r["id"])]) for r in rows]


def measured(run: Path, prompt_set: str, draft: str) -> float | None:
    """The run's own mean accepted length of `spork/DRAFT` (its default shape) on `prompt_set`, when it has one."""
    recs = [json.loads(line) for f in sorted(run.glob(f"{prompt_set}__spork_{draft}.*jsonl"))
            for line in f.read_text().splitlines()]
    recs = [r for r in recs if "steps" in r]
    return round(sum(r["committed_tokens"] for r in recs) / sum(r["steps"] for r in recs), 3) if recs else None


def subset(store: Datastore, fraction: float, seed: int = 0) -> Datastore:
    """A store over a random `fraction` of the corpus' sequences (what a smaller corpus would give)."""
    if fraction >= 1:
        return store
    ends = [i for i, t in enumerate(store.tokens.tolist()) if t == SEP]
    seqs = [store.tokens[a + 1:b].tolist() for a, b in zip([-1, *ends[:-1]], ends)]
    pick = sorted(random.Random(seed).sample(range(len(seqs)), max(1, round(fraction * len(seqs)))))
    return Datastore.build([seqs[i] for i in pick])


def shapes(text: str) -> list[tuple[int, int, int] | None]:
    """"default,8x8x64" -> [None (the drafter's measured default), (8, 8, 64)]."""
    out = []
    for x in text.split(","):
        if x == "default":
            out.append(None)
            continue
        parts = x.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(f"--shapes {x!r}: write KxMxN (forks, depth, nodes), e.g. 8x8x64, or default")
        out.append(tuple(int(p) for p in parts))
    return out


def main(a) -> int:
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.checkpoint.tokenizer import load_tokenizer

    bad = [d for d in a.drafts if not any(is_kind(d, kind) for kind in DRAFTS)]
    if bad:
        raise UserError(f"--drafts {' '.join(bad)}: replay runs the drafters that need no model "
                        f"({', '.join(kind.name for kind in DRAFTS)})")
    eng, cost = Path(a.engines), cost_curve(a.costs)
    tok = load_tokenizer(eng, "hf", mf.spec_config(mf.read(eng)["model"]).eos_token_ids)
    store = Datastore.load(eng) if any(is_kind(d, STORE) for d in a.drafts) else None
    fractions = [float(f) for f in a.store_fractions.split(",")] if store is not None else [1.0]
    stores = {f: subset(store, f) for f in fractions} if store is not None else {}  # built once each
    rows = []
    for prompt_set in a.prompts.split(","):
        pairs = [(tok.encode_prompt(p), ids) for p, ids in answers(Path(a.run), prompt_set)]
        for draft in a.drafts:
            for shape in shapes(a.shapes):
                spec = SpecConfig.for_draft(draft, *(shape or ()))
                for f in fractions if is_kind(draft, STORE) else [1.0]:
                    st = stores[f] if is_kind(draft, STORE) else None
                    make = (lambda st=st: StoreDrafter(NgramDrafter(4), st)) if st else (lambda: NgramDrafter(4))
                    r = sum((replay(make(), spec, p, ids, cost) for p, ids in pairs), Replayed(0, 0, 0, 0.0))
                    rows.append({"prompts": prompt_set, "draft": draft, "answers": len(pairs),
                                 "shape": f"{spec.tree_width}x{spec.tree_depth}x{spec.tree_budget}",
                                 "store_tokens": int((st.tokens != SEP).sum()) if st else 0,
                                 # as Stats counts it: the prefill's token is a step of its own
                                 "mean_accepted_length": round((r.tokens + len(pairs)) / (r.steps + len(pairs)), 3),
                                 "nodes_per_step": round(r.nodes / r.steps, 2),
                                 "est_speedup": round(r.tokens / r.cost, 3),
                                 "measured_accepted_length": measured(Path(a.run), prompt_set, draft)
                                 if shape is None and f >= 1 else None})
                    print(f"[bench replay] {rows[-1]}", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps({"costs": a.costs or f"prior (1 + {PRIOR_SLOPE} per extra token)", "rows": rows}))
        return 0
    print(f"costs: {a.costs or f'the scheduler prior, 1 + {PRIOR_SLOPE} per extra token'} (estimates, not measured)")
    print("| prompts | draft | shape | store tokens | mean accepted length (the run's own) | draft nodes per step | "
          "est. speedup |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        own = "" if r["measured_accepted_length"] is None else f" ({r['measured_accepted_length']:.2f})"
        print(f"| {r['prompts']} | {r['draft']} | {r['shape']} | {r['store_tokens']:,} | "
              f"{r['mean_accepted_length']:.2f}{own} | {r['nodes_per_step']:.2f} | {r['est_speedup']:.2f}x |")
    return 0
