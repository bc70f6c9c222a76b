"""A batched forward that one sequence cannot break for the others: when the batch's forward raises, each sequence
runs again alone (once, so a transient failure costs one retry and a bad sequence is found in len(seqs) forwards),
and only the ones whose own forward raises get an error. The engine core's target forwards and the drafts' batched
depths (drafters.drive) run through it."""
from __future__ import annotations

import logging

import torch

from spork_trt.engines import SeqInput

log = logging.getLogger("spork_trt.engines")


def forward_each(engine, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor | Exception]:
    """engine.forward_batch(seqs, hidden), with each sequence's logits [r_b, V] or the exception its forward alone
    raised. Given a `hidden` list, each sequence's hidden states [n_b, k*C] are appended to it (None for one that
    failed). Before a retry, each cache forgets the rows the failed forward wrote, so it runs at the same positions."""
    pending, before = [s.cache.pending for s in seqs], len(hidden or ())
    try:
        return engine.forward_batch(seqs, hidden)
    except Exception as e:  # noqa: BLE001 - any failure: find the sequences it belongs to
        log.warning("a batched forward of %d sequences failed (%r): running each alone", len(seqs), e)
    if hidden is not None:
        del hidden[before:]
    out: list[torch.Tensor | Exception] = []
    for s, p in zip(seqs, pending):
        s.cache.forget(p)
        own = [] if hidden is not None else None
        try:
            out.append(engine.forward_batch([s], own)[0])
        except Exception as e:  # noqa: BLE001 - this sequence's own failure: its caller fails it alone
            s.cache.forget(p)
            out.append(e)
            own = [None]
        if hidden is not None:
            hidden.append(own[0])
    return out
