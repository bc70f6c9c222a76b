"""The "score" step: the early-layer verifier and its calibrated confidence head.

The verifier is the target's first N layers + final norm + LM head (`verifier.onnx`, also the early-exit draft).
It runs on the target's own KV cache: its layers are the target's first N, so the committed prefix rows it needs
are already there; the rows it writes for the tree are dropped right after (the target writes its own).

Per draft node i (parent p) the head sees features of the verifier's distribution at p (the log probability of
i's token, of the verifier's own top token, the entropy, whether i's token is the top one, its rank), the
drafter's own score of i, the verifier's log probability of p's token, how many draft tokens this request's recent
steps had accepted, the tree (depth, sibling rank) and whether i's path repeats the request's context
(`repetition.py`); it returns confidence = P(node accepted | parent accepted), a logistic regression fitted by
`python -m export calibrate` on real verdicts of the target. Path survival = product of confidences along the path
(root 1.0); it never grows with depth, so pruning at a threshold keeps every kept node's parent.

The head is stored as JSON (weights, feature standardization, fit metadata): no pickle is ever loaded. A head
belongs to the drafter it was fitted on (the drafter's own score is a feature, and what it means differs: a
probability for model drafters, a matched suffix length for n-gram), so a build keeps one head per drafter,
`confidence_head-<drafter>.json`, and a request is scored only with its own drafter's head.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from spork_trt import atomic
from spork_trt.draft_kinds import NGRAM
from spork_trt.engines import SeqInput
from spork_trt.errors import UserError
from spork_trt.engines.kv_cache import Rows
from spork_trt.spec.repetition import REPETITION, repetition
from spork_trt.spec.tree import DraftTree, compile_tree

HEAD_GLOB = "confidence_head*.json"
MAX_DEPTH = 6  # depth one-hot: 1..5 and 6+
MAX_RANK = 3  # sibling rank one-hot: 0, 1, 2+
FEATURES = ("logp", "top_logp", "entropy", "is_top", "log_rank", "draft_score", "parent_logp", "recent_accepted",
            *(f"depth_{d}" for d in range(1, MAX_DEPTH + 1)), *(f"rank_{r}" for r in range(MAX_RANK)), *REPETITION)


@dataclass(frozen=True)
class Scored:
    features: np.ndarray  # [N, F] row 0 (the root) is zeros
    depth: tuple[int, ...]  # [N]
    confidence: np.ndarray | None  # [N] P(accepted | parent accepted); root 1.0; None without a head
    survival: np.ndarray | None  # [N] product of confidences along the path


@dataclass(frozen=True)
class ConfidenceHead:
    """Logistic regression over standardized FEATURES."""

    weights: tuple[float, ...]  # [F]
    bias: float
    mean: tuple[float, ...]  # [F]
    scale: tuple[float, ...]  # [F]
    verifier_layers: int
    meta: dict = field(default_factory=dict)  # drafter, prompts fitted on, held-out metrics

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [N, F] -> P(accepted | parent accepted) [N]."""
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale) @ np.asarray(self.weights) + self.bias
        return 1.0 / (1.0 + np.exp(-z))

    def save(self, path: Path) -> Path:
        return atomic.write_text(path, json.dumps({"format_version": 1, "features": list(FEATURES), **asdict(self)},
                                                  indent=1))

    @classmethod
    def load(cls, path: Path) -> ConfidenceHead:
        d = json.loads(Path(path).read_text())
        if d.get("format_version") != 1 or d.get("features") != list(FEATURES):
            raise UserError(f"{path} was written for other confidence features: rerun `python -m export calibrate`")
        return cls(tuple(d["weights"]), d["bias"], tuple(d["mean"]), tuple(d["scale"]), d["verifier_layers"],
                   d.get("meta", {}))


def head_file(draft: str) -> str:
    """The file name of `draft`'s head in a build folder (`model:PATH` and `early-exit:N` made file-safe)."""
    return "confidence_head-" + "".join(c if c.isalnum() or c in "-." else "_" for c in draft) + ".json"


def load_heads(d: Path, verifier_layers: int) -> dict[str, ConfidenceHead]:
    """Every head calibrated for the build in `d`, by drafter (an older single `confidence_head.json` included)."""
    heads: dict[str, ConfidenceHead] = {}
    for f in sorted(d.glob(HEAD_GLOB)):  # confidence_head-*.json sort before an older confidence_head.json
        head = ConfidenceHead.load(f)
        draft = head.meta.get("draft", NGRAM.name)  # an older single head: fitted on ngram
        if head.verifier_layers != verifier_layers:
            raise UserError(f"{f} was calibrated for a {head.verifier_layers}-layer verifier, this build has "
                            f"{verifier_layers}: rerun `python -m export calibrate --engines {d} --draft {draft}`")
        heads.setdefault(draft, head)  # a per-drafter file wins over an older single one
    return heads


def fit_head(x: np.ndarray, y: np.ndarray, verifier_layers: int, l2: float = 1e-2, meta: dict | None = None
             ) -> ConfidenceHead:
    """x [N, F], y [N] in {0, 1}: L2-regularized logistic regression by Newton's method (convex; a few
    iterations on a few thousand nodes)."""
    if len(y) < 20 or y.min() == y.max():
        raise UserError(f"calibration needs both accepted and rejected nodes (got {len(y)} nodes, "
                        f"{int(y.sum())} accepted): use more prompts (--limit) or tokens (--max-new-tokens)")
    mean, scale = x.mean(0), x.std(0)
    scale[scale < 1e-6] = 1.0
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])  # [N, F + 1]
    w = np.zeros(z.shape[1])
    reg = np.full(z.shape[1], l2 * len(y))
    reg[-1] = 0.0  # the bias is not shrunk
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-z @ w))
        grad = z.T @ (p - y) + reg * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return ConfidenceHead(tuple(w[:-1].tolist()), float(w[-1]), tuple(mean.tolist()), tuple(scale.tolist()),
                          verifier_layers, meta or {})


@dataclass
class Verifier:
    engine: object  # the target's first N layers + norm + LM head; runs on the target's cache (see module doc)
    head: ConfidenceHead | None

    def forward(self, rows: Rows, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        """The verifier's logits [1, T, V] over new tokens after the target's committed `rows` (its KV cache), run
        on them; the rows it writes are dropped (the target writes its own)."""
        assert rows.pending == 0, "run the verifier before the target's forward of this step"
        logits = self.engine.forward(rows, input_ids, position_ids, mask)
        rows.commit([])
        return logits

    def score(self, rows: Rows, behind: list[int], tree: DraftTree, recent: float = 0.0, context: Sequence[int] = (),
              prompt_len: int = 0) -> Scored:
        """Features (and, with a head, confidences) of every node of `tree`, which follows the target's committed
        `rows` and then `behind` (committed tokens the target has not run yet, gate mode only). `recent`: draft
        tokens accepted per step lately (the scheduler's moving average); `context`: the request's tokens so far
        (its first `prompt_len` the prompt), ending with the tree's root (empty: the root alone)."""
        return score_batch([ScoreJob(self, rows, behind, tree, recent, context, prompt_len)])[0]


@dataclass(frozen=True)
class ScoreJob:
    """One request's tree to score (Verifier.score's arguments)."""

    verifier: Verifier  # the request's: its confidence head scores the nodes
    rows: Rows  # the request's target KV cache: its committed rows
    behind: list[int]
    tree: DraftTree
    recent: float = 0.0
    context: Sequence[int] = ()
    prompt_len: int = 0


def score_batch(jobs: list[ScoreJob]) -> list[Scored]:
    """Score several requests' trees with ONE verifier forward (the engine core's step): every job's verifier
    must share the first one's engine (Runtime.verifier gives every request the same), each tree runs after its
    own target's committed rows and the rows it writes are dropped; each job is scored with its own head."""
    engine = jobs[0].verifier.engine
    assert all(j.verifier.engine is engine for j in jobs), "batched scoring needs one shared verifier engine"
    fulls = [j.tree.after(j.behind) for j in jobs]
    bufs = [compile_tree(f.parents, j.rows.length) for f, j in zip(fulls, jobs)]
    seqs = []
    for j, f, buf in zip(jobs, fulls, bufs):
        assert j.rows.pending == 0, "run the verifier before the target's forward of this step"
        seqs.append(SeqInput(j.rows, tuple(f.tokens), tuple(buf.position_ids[0].tolist()), buf.ancestors))
    logits = engine.forward_batch(seqs)  # [len(behind) + N, V] each
    for j in jobs:
        j.rows.commit([])
    return [scored(j, buf, lg) for j, buf, lg in zip(jobs, bufs, logits)]


def scored(j: ScoreJob, buf, logits: torch.Tensor) -> Scored:
    """One job's Scored from the verifier's logits [len(behind) + N, V] at its tree."""
    b, tree = len(j.behind), j.tree
    depth = tuple(d - b for d in buf.depth[b:])
    ctx = np.asarray(j.context if len(j.context) else tree.tokens[:1])
    assert ctx[-1] == tree.tokens[0], "the context ends with the tree's root"
    x = node_features(tree, logits[b:], depth, j.recent)
    x[:, -len(REPETITION):] = repetition(ctx, j.prompt_len, tree, depth)
    conf = surv = None
    head = j.verifier.head
    if head is not None:
        conf = np.concatenate([[1.0], head(x[1:])]) if len(tree) > 1 else np.ones(1)
        surv = survival(tree.parents, conf)
    return Scored(x, depth, conf, surv)


def node_features(tree: DraftTree, logits: torch.Tensor, depth: tuple[int, ...], recent: float) -> np.ndarray:
    """logits [N, V] of the verifier at every node, depth [N] (root 0) -> features [N, F] (row 0 zeros; the
    REPETITION columns are left to `repetition`)."""
    n = len(tree)
    x = np.zeros((n, len(FEATURES)), dtype=np.float64)
    if n == 1:
        return x
    parents = sorted(set(tree.parents[1:]))
    lp = torch.log_softmax(logits[parents].float(), -1)  # [P, V]
    row = {p: j for j, p in enumerate(parents)}
    top = lp.max(-1).values  # [P]
    ent = -(lp.exp() * lp).sum(-1)  # [P]
    seen: dict[int, int] = {}
    node_lp = [0.0] * n  # the verifier's log probability of each node's token (root: 0)
    c = FEATURES.index("depth_1")
    for i in range(1, n):
        p, tok = tree.parents[i], tree.tokens[i]
        j = row[p]
        node_lp[i] = max(float(lp[j, tok]), -30.0)
        rank = int((lp[j] > lp[j, tok]).sum())
        sib = seen.get(p, 0)
        seen[p] = sib + 1
        draft = 1.0 if tree.score is None else tree.score[i]
        x[i, :c] = (node_lp[i], float(top[j]), float(ent[j]), float(rank == 0), math.log1p(rank), draft,
                    node_lp[p], math.log1p(recent))
        x[i, c + min(depth[i], MAX_DEPTH) - 1] = 1.0
        x[i, c + MAX_DEPTH + min(sib, MAX_RANK - 1)] = 1.0
    return x


def survival(parents: tuple[int, ...], confidence: np.ndarray) -> np.ndarray:
    """[N] product of confidences from the root to each node (parents precede children)."""
    s = np.ones(len(parents))
    for i in range(1, len(parents)):
        s[i] = s[parents[i]] * confidence[i]
    return s


def gate_path(tree: DraftTree, scored: Scored, tau: float) -> list[int]:
    """Gate mode: from the root, follow the most confident child while the path survival stays >= tau.
    Returns the nodes (root excluded) the verifier alone accepts; empty when the first one falls short."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    path, node = [], 0
    while node in children:
        best = max(children[node], key=lambda c: scored.survival[c])
        if scored.survival[best] < tau:
            break
        path.append(best)
        node = best
    return path
