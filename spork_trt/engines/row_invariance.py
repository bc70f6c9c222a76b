"""Row-invariant forwards: the same kernels for every row count, so a row's logits do not depend on how many rows
share its forward.

ONNX Runtime on CPU takes other kernels for a sequence of one token than for several (GroupQueryAttention's
token-generation path, the single-row GEMV of MatMul and MatMulNBits), also inside a packed batch whose other
sequences have more (measured: a 1-token sequence packed beside a 5-token one gets other logits than the same token
given a dummy row, by up to 0.93 on an int4 target), while every sequence of two or more rows, alone, in a chain
or packed with other sequences, computes each row bitwise the same (tests/test_row_invariance.py).
In fp32 the two paths differ by ~3e-5 in the logits; a quantized target (MatMulNBits, int8 activations) amplifies
that through its activation rounding to ~0.5, enough to change the argmax: a tree (many rows) would then verify
other tokens than plain decoding (one row) computes. So a target engine with `min_rows = 2` gives every sequence
of a forward that would run one row a dummy row: it attends its context and itself only (no real row attends it), its logits
are not asked for, and its KV row is dropped from the pending rows after the forward.
"""
from __future__ import annotations

import torch

from spork_trt.engines import SeqInput


def with_dummy_row(s: SeqInput) -> SeqInput:
    """`s` with one more token after its own: position after its last, attending itself (and the context) only."""
    n = len(s.tokens)
    ancestors = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [n+1, n+1]
    ancestors[:n, :n] = s.ancestors
    ancestors[n, n] = True
    seen = None if s.seen is None else torch.cat([s.seen, torch.zeros(1, s.seen.shape[1], dtype=torch.bool)])
    return SeqInput(s.cache, (*s.tokens, s.tokens[-1]), (*s.positions, max(s.positions) + 1), ancestors,
                    tuple(s.rows), seen)


def pad_to_rows(seqs: list[SeqInput], min_rows: int) -> list[int]:
    """The sequences to give a dummy row so that each runs the multi-row kernels: every one of fewer than
    `min_rows` tokens whose cache has room for one more ([] when `min_rows` <= 1)."""
    if min_rows <= 1:
        return []
    return [i for i, s in enumerate(seqs)
            if len(s.tokens) < min_rows and s.context + len(s.tokens) + 1 <= s.cache.max_len]


def forward_padded(forward_batch, seqs: list[SeqInput], hidden: list | None, pad: list[int]) -> list[torch.Tensor]:
    """`forward_batch` over `seqs` with each sequence in `pad` given a dummy row, then everything about those rows
    removed: their pending KV rows (the last one each wrote) and their hidden states."""
    padded = [with_dummy_row(s) if j in pad else s for j, s in enumerate(seqs)]
    before = 0 if hidden is None else len(hidden)
    out = forward_batch(padded, hidden)
    for i in pad:
        seqs[i].cache.pending -= 1
        if hidden is not None:
            hidden[before + i] = hidden[before + i][:-1]  # [n_i + 1, k*C] -> [n_i, k*C]
    return out
