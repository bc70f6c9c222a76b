"""Training-time test: the draft head unrolled on its own outputs over a padded batch, with the loss per step
(against the target's top-1, or its whole distribution: `Teacher`), and the attention mask each step needs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spork_trt.spec.draft_head import DraftHead


class StepKV:
    """The head's attention over every unrolled step: step j's keys/values after those of steps 1..j-1."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []  # per step [B, Hkv, T, D]
        self.v: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)  # [B, Hkv, j*T, D]


def step_mask(j: int, t: int, valid: torch.Tensor) -> torch.Tensor:
    """[B, T, j*T]: step j's query at p sees step 1 at s <= p-j+1 (the committed entries and its chain's root) and
    step i at p-j+i for i = 2..j (its own chain). valid [B, T]: real (not padding) positions."""
    p = torch.arange(t)
    blocks = [p[None, :] <= p[:, None] - j + 1]  # [T, T] step 1
    blocks += [p[None, :] == p[:, None] - j + i for i in range(2, j + 1)]
    m = torch.cat(blocks, dim=1)[None] & valid.repeat(1, j)[:, None, :]  # [B, T, j*T]
    m[:, p, (j - 1) * t + p] = True  # a node always sees itself (padding rows too: no empty softmax)
    return m


class Teacher(torch.nn.Module):
    """The target's next-token distribution over the draft vocabulary, from its last layer's output (a feature):
    softmax(lm_head[d2t](norm(x)))."""

    def __init__(self, target, d2t: torch.Tensor) -> None:
        super().__init__()
        self.norm = target.norm
        self.register_buffer("w", target.lm_head.weight.detach()[d2t].clone())  # [N, C]

    @torch.no_grad()
    def forward(self, last: torch.Tensor) -> torch.Tensor:
        """last [B, T, C] -> probabilities [B, T, N]"""
        return torch.softmax(F.linear(self.norm(last), self.w).float(), dim=-1)


def unroll(head: DraftHead, embed, tokens, feats, labels, valid, steps: int, t2d: torch.Tensor,
           teacher: Teacher | None = None):
    """Run `steps` unrolled head steps over a padded batch; returns per step (loss, correct [B, T], counted [B, T]).
    tokens, labels [B, T] (target ids); feats [B, T, k*C]; valid [B, T]. With a `teacher` the loss is the
    cross-entropy against its distribution at p+1 (the last C columns of feats: the last layer's output), else
    against the target's top-1."""
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, t)
    emb = embed(tokens[:, 1:].clamp(min=0))  # [B, T-1, C]: x_{p+1}
    emb = F.pad(emb, (0, 0, 0, 1))  # [B, T, C]
    want = F.pad(labels[:, 1:], (0, 1), value=-1)  # [B, T]: the target's top-1 for x_{p+2}
    has = valid & F.pad(valid[:, 1:], (0, 1), value=False)  # x_{p+1} and its label exist
    target = torch.where(has & (want >= 0), t2d[want.clamp(min=0)], torch.full_like(want, -100))  # draft ids
    soft = None if teacher is None else F.pad(teacher(feats[:, 1:, -head.hc.dim:]), (0, 0, 0, 1))  # [B, T, N]
    kv, g, out = StepKV(), head.fuse(feats), []
    for j in range(1, steps + 1):
        h, logits = head(emb, g, pos, step_mask(j, t, valid), kv)
        counted = has & (pos >= j - 1)  # a depth-j node needs a chain root at p-j+1 >= 0
        tj = torch.where(counted, target, torch.full_like(target, -100))
        if soft is None:
            loss = F.cross_entropy(logits.reshape(b * t, -1).float(), tj.reshape(-1), ignore_index=-100)
        else:
            rows = tj >= 0  # [B, T]
            loss = -(soft[rows] * F.log_softmax(logits[rows].float(), dim=-1)).sum() / rows.sum().clamp(min=1)
        correct = (head.d2t[logits.argmax(-1)] == want) & counted
        out.append((loss, correct, counted))
        g = F.pad(h[:, :-1], (0, 0, 1, 0))  # step j+1 at p reads step j's output at p-1
    return out
