"""Log-probabilities of committed tokens: the target's own, read from the rows that verified them.

Each committed token was predicted by one target row: the bonus and every accepted token by the row of the tree node
before it (the verdict's path), the first token by the prompt's last row. Those rows are the same bits whether the
token was drafted or not and whatever else rode in the forward (the engines' row invariance), so a token's
log-probabilities are the same under speculation, under batching and alone. They are the model's distribution:
log_softmax of the logits after the grammar mask when one applies (a forbidden token is -inf), before temperature,
top-p and top-k (as OpenAI and vLLM report them).

  token_logprobs   rows [n, V], tokens [n], k -> n TokenLogprob (the token's and the k likeliest)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_TOP = 20  # most alternatives a token reports (OpenAI's bound on top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # the token's natural-log probability under the target
    # the k likeliest (token, logprob), likeliest first (ties: lower id first); fewer where fewer tokens have any
    # probability (a grammar's forbidden tokens are left out, so a forced token's is itself alone)
    top: tuple[tuple[int, float], ...]


def certain(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """[n, V] rows that allow only `tokens` (each at logit 0): a masked target's rows at forced positions give the
    same log-probabilities (0 for the token, -inf for every other)."""
    rows = torch.full((len(tokens), vocab_size), float("-inf"))
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return rows


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """rows [n, V]: the target's logits that predicted `tokens` [n]; `k` <= MAX_TOP alternatives each. Row by row, in
    float64: a row's result never depends on the rows beside it."""
    assert rows.shape[0] == len(tokens) and 0 <= k <= MAX_TOP, (rows.shape, len(tokens), k)
    out = []
    for row, t in zip(rows, tokens):
        lp = torch.log_softmax(row.detach().to("cpu", torch.float64), -1)  # [V]
        top = torch.topk(lp, k, sorted=True) if k else None
        pairs = tuple((i, v) for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > -math.inf) \
            if top is not None else ()
        out.append(TokenLogprob(t, float(lp[t]), tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))))
    return out
