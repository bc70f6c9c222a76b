"""Engines run one model over new tokens against their own preallocated KV cache.

Interface (the torch engine is the reference; ONNX Runtime and TensorRT engines follow it):
  reset(max_len)                                   ready for a new sequence of at most max_len positions
  forward(input_ids [B,T], position_ids [B,T], mask [B,T,S]) -> logits [B,T,V]
                                                   S = length + pending + T; appends T pending KV rows
  commit(rows=None)                                keep pending rows (indices from `length`; None: all)
  truncate(length)                                 roll back to `length` committed rows
  length, pending                                  committed rows; rows written since the last commit
"""

import torch

from ..model import causal_mask


def forward_chain(engine, ids: list[int]) -> torch.Tensor:
    """Run tokens as one causal chain after every row the engine holds; returns logits [T, V] (rows stay pending)."""
    base, n = engine.length + engine.pending, len(ids)
    return engine.forward(torch.tensor([ids]), torch.arange(base, base + n)[None], causal_mask(base, n))[0]


def prefill(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Run a prompt and commit it; returns the last position's logits [V]."""
    logits = forward_chain(engine, prompt_ids)
    engine.commit()
    return logits[-1]
