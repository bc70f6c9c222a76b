"""Decoding loops. Plain decoding: one target forward per token, the baseline every speedup is measured against."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .config import GenerateConfig
from .errors import UserError
from .model import causal_mask
from .sampling import make_generator, pick
from .stats import Stats
from .stopping import StopState

OnTokens = Callable[[list[int]], None]  # receives committed tokens as they are produced


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS excluded)
    stop_reason: str  # "eos" | "stop_string" | "max_tokens"
    stats: Stats
    text: str | None = None  # set when a decode function was given


def budget(prompt_len: int, cfg: GenerateConfig, context: int) -> int:
    """New tokens allowed: max_new_tokens, clipped to the context window. Validates the prompt length."""
    if prompt_len == 0:
        raise UserError("the prompt encodes to no tokens: pass some text")
    if prompt_len >= context:
        raise UserError(f"the prompt has {prompt_len} tokens but the context window is {context}: shorten it")
    return min(cfg.max_new_tokens, context - prompt_len)


def prefill(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Run the prompt through the engine and commit it; returns the logits [V] at the last prompt position."""
    n = len(prompt_ids)
    logits = engine.forward(torch.tensor([prompt_ids]), torch.arange(n)[None], causal_mask(0, n))
    engine.commit()
    return logits[0, -1]


def generate_plain(engine, prompt_ids: list[int], cfg: GenerateConfig, eos_ids: frozenset[int],
                   decode: Callable[[list[int]], str] | None = None, on_tokens: OnTokens | None = None,
                   ) -> GenerationResult:
    max_new = budget(len(prompt_ids), cfg, engine.cfg.max_seq_len)
    stop = StopState(eos_ids, max_new, cfg.stop_strings, decode)
    stats, gen = Stats(), make_generator(cfg.sampling.seed)
    t0 = time.perf_counter()
    engine.reset(len(prompt_ids) + max_new)
    logits = prefill(engine, prompt_ids)  # [V]
    stats.prefill_s = time.perf_counter() - t0
    while True:
        kept = stop.add([pick(logits, cfg.sampling, gen)])
        if kept:
            stats.record_step(draft=0, accepted=0)
            stats.committed_tokens += len(kept)
            if on_tokens:
                on_tokens(kept)
        if stop.reason is not None:
            break
        pos = engine.length
        logits = engine.forward(torch.tensor([kept]), torch.tensor([[pos]]), causal_mask(pos, 1))[0, -1]
        engine.commit()
    stats.time_s = time.perf_counter() - t0
    return GenerationResult(stop.tokens, stop.reason, stats, stop.text() if decode else None)
