"""The draft head's agreement with the target where drafting happens (answer tokens of text it never trained on):
per unrolled step, the accepted length of a greedy chain, and depth 1 by the target's own confidence. Used by
`export train-draft` (held-out self-data) and `bench agreement --head` (benchmark answers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from spork_trt.learn.head_data import Features, batches, by_length
from spork_trt.learn.unroll import Teacher, unroll

if TYPE_CHECKING:
    from spork_trt.learn.train_draft import TrainConfig


CONFIDENCE = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)  # lower edges of the target's top-1 probability buckets


@dataclass(frozen=True)
class Evaluation:
    agreement: list[float]  # per step: top-1 agreement with the target on held-out text
    accepted_length: float  # mean tokens a greedy chain of depth `steps` commits per step (accepted + 1)
    tokens: int
    # with a teacher: per CONFIDENCE bucket of the target's own top-1 probability for the predicted token, the share
    # of scored tokens in it and the depth-1 agreement there (hard text, or a weak head?)
    by_confidence: list[dict] | None = None


def evaluate(head, embed, f: Features, seqs: list[int], steps: int, t2d, cfg: TrainConfig,
             starts: list[int], teacher: Teacher | None = None) -> Evaluation:
    """Held-out agreement where drafting happens: predictions of answer tokens only (x_{p+2} at or after the
    sequence's answer start, `starts[s]`). The chat template's system prompt, the same in every sequence, would
    otherwise be scored too, and a head learns it by heart."""
    hits, counts = [0] * steps, [0] * steps
    chain, roots = 0.0, 0
    edges = torch.tensor(CONFIDENCE[1:])
    b_hits, b_counts = torch.zeros(len(CONFIDENCE)), torch.zeros(len(CONFIDENCE))
    order = by_length(f, seqs, cfg.batch, len(seqs))
    with torch.no_grad():
        for i, (tok, lab, fe, valid) in enumerate(batches(f, order, cfg.batch, cfg.max_len, cfg.device)):
            first = torch.tensor([starts[s] for s in order[i * cfg.batch:(i + 1) * cfg.batch]], device=tok.device)
            answer = torch.arange(tok.shape[1], device=tok.device)[None] + 2 >= first[:, None]  # [B, T]
            out = [(loss, correct & answer, counted & answer)
                   for loss, correct, counted in unroll(head, embed, tok, fe, lab, valid, steps, t2d)]
            for j, (_, correct, counted) in enumerate(out):
                hits[j] += int(correct.sum())
                counts[j] += int(counted.sum())
            if teacher is not None:  # the target's top-1 probability at p+1, for x_{p+2}
                conf = F.pad(teacher(fe[:, 1:, -head.hc.dim:]).amax(-1), (0, 1)).cpu()  # [B, T]
                bucket = torch.bucketize(conf, edges, right=True)[out[0][2].cpu()]
                b_counts += torch.bincount(bucket, minlength=len(CONFIDENCE)).float()
                b_hits += torch.bincount(bucket, out[0][1].cpu()[out[0][2].cpu()].float(), len(CONFIDENCE))
            # a chain rooted at r accepts depth j when step j is right at r + j - 1, and every depth before it
            alive = out[0][2].clone()  # [B, T] roots with a depth-1 node
            roots += int(alive.sum())
            for j, (_, correct, counted) in enumerate(out):
                shifted = F.pad(correct[:, j:], (0, j), value=False)  # [B, T] at the root's index
                alive &= shifted
                chain += float(alive.sum())
    by_conf = None if teacher is None else [
        {"confidence": lo, "share": float(n / max(b_counts.sum(), 1)), "agreement": float(h / max(n, 1))}
        for lo, h, n in zip(CONFIDENCE, b_hits, b_counts)]
    return Evaluation([h / max(c, 1) for h, c in zip(hits, counts)], 1 + chain / max(roots, 1), counts[0], by_conf)
