"""`python -m bench agreement --head DIR`: how often a trained draft head (`export train-draft`) predicts what the
target writes on text it never trained on: teacher-forced on the target's own greedy answers to benchmark prompts
(the references `bench agreement` makes), scored on answer tokens only, as `export train-draft` scores its held-out
self-data. Reports top-1 agreement by depth (training-time test: depth j reads the head's own outputs of depths
1..j-1) and the mean accepted length of a greedy chain of that depth, per prompt set; and depth-1 agreement by the
target's own top-1 probability for the token predicted (a head that misses where the target is sure is undertrained;
one that misses only where the target hesitates meets hard text).

The features are the torch reference target's (the checkpoint the build was made from), as in training."""
from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from spork_trt.spec.draft_head import load_head, target_to_draft
from spork_trt.errors import UserError
from spork_trt.export.artifacts import head_source
from spork_trt.learn.head_data import extract
from spork_trt.learn.head_eval import CONFIDENCE, evaluate
from spork_trt.learn.train_draft import TrainConfig
from spork_trt.learn.unroll import Teacher
from spork_trt.checkpoint.weights import load_checkpoint


def head_rows(head_arg: str, source: dict, refs: dict[str, list[tuple[list[int], list[int]]]],
              target=None) -> list[dict]:
    """One row per prompt set: the head's agreement by depth on `refs[set]` [(prompt ids, greedy output)]. `source`
    is the build manifest's (path, sha256); `target` (a model.Transformer) stands in for its checkpoint in tests."""
    path, _ = head_source(head_arg, source["sha256"])
    if path is None:
        raise UserError(f"--head {head_arg}: no draft head there")
    head, meta = load_head(path)
    if meta.get("target_sha256") not in (None, source["sha256"]):
        raise UserError(f"--head {head_arg} was trained for another target (sha256 {meta['target_sha256'][:12]}...) "
                        f"than the build's ({source['sha256'][:12]}...)")
    if head.hc.layout != "eagle1":
        raise UserError(f"--head {head_arg}: a converted {head.hc.layout} head; agreement is measured for heads "
                        "trained here (eagle1)")
    target = (target if target is not None else load_checkpoint(source["path"]).model).eval()
    steps = int(meta.get("settings", {}).get("steps", 3))
    t2d = target_to_draft(head.d2t, target.cfg.vocab_size)  # [V]
    teacher = Teacher(target, head.d2t) if head.hc.taps[-1] == target.cfg.n_layers else None
    rows = []
    for name, seqs in refs.items():
        print(f"[agreement] head on {name}: {len(seqs)} answers", file=sys.stderr, flush=True)
        full = [ids + out for ids, out in seqs]
        cfg = TrainConfig(batch=4, max_len=max(map(len, full)))
        with tempfile.TemporaryDirectory() as tmp:
            f = extract(target, full, head.hc.taps, Path(tmp))
            ev = evaluate(head, target.embed, f, list(range(len(full))), steps, t2d, cfg, [len(i) for i, _ in seqs],
                          teacher)
            del f  # its memory maps, before the folder goes
        rows.append({"prompts": name, "head": str(path), **asdict(ev),
                     "train_tokens": meta.get("train_tokens"), "epochs": meta.get("epoch")})
    return rows


def head_table(rows: list[dict]) -> str:
    depth = max(len(r["agreement"]) for r in rows)
    lines = ["| prompts | " + " | ".join(f"agreement depth {j + 1}" for j in range(depth)) +
             " | chain accepted length | scored tokens |",
             "| --- |" + " ---: |" * (depth + 2)]
    lines += [f"| {r['prompts']} | " + " | ".join(f"{a:.3f}" for a in r["agreement"]) +
              f" | {r['accepted_length']:.2f} | {r['tokens']} |" for r in rows]
    conf = [r for r in rows if r.get("by_confidence")]
    if conf:  # where it errs: by how sure the target itself is of the token the head predicts
        edges = [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(CONFIDENCE, [*CONFIDENCE[1:], 1.0])]
        lines += ["", "Depth-1 agreement (share of scored tokens) by the target's own top-1 probability:", "",
                  "| prompts | " + " | ".join(edges) + " |", "| --- |" + " ---: |" * len(edges)]
        lines += [f"| {r['prompts']} | " + " | ".join(f"{b['agreement']:.2f} ({b['share']:.0%})"
                                                        for b in r["by_confidence"]) + " |" for r in conf]
    return "\n".join(lines)
