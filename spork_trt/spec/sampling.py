"""Turning logits into tokens: greedy argmax, or sampling from the temperature / top-k / top-p processed distribution.

`processed_probs` is the one definition of "the target distribution" that plain sampling and speculative
verification both use, so speculative sampling reproduces exactly what plain sampling would draw from.
"""
from __future__ import annotations

import torch

from spork_trt.config import SamplingConfig


def processed_probs(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p (greedy: one-hot argmax)."""
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= s.top_p, 0.0)  # keeps the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def pick(logits: torch.Tensor, s: SamplingConfig, gen: torch.Generator) -> int:
    """Next token from logits [V] (on any device: greedy takes the argmax there; sampling draws on the host, with
    `gen`)."""
    if s.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(processed_probs(logits[None], s)[0].cpu(), 1, generator=gen))
