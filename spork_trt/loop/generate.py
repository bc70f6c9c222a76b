"""`generate`: one request through the engine core, a batch of one (engine_core.py holds the loop: propose -> score
(prune, or gate) -> verify -> commit, streamed). Plain decoding is the same loop without a drafter (each step's tree
is the root alone), so every mode shares one stop rule, one token accounting, one code path."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.loop.admission import size_request
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.loop.request import GenerationResult, Request, Submission
from spork_trt.loop.stats import Stats
from spork_trt.spec.verifier import Verifier

OnTokens = Callable[[list[int]], None]  # receives committed tokens as they are produced

__all__ = ["GenerationResult", "OnTokens", "generate", "run_alone", "run_many"]


def generate(target, prompt_ids: list[int], cfg: GenerateConfig, eos_ids: frozenset[int],
             decode: Callable[[list[int]], str] | None = None, on_tokens: OnTokens | None = None,
             drafter=None, spec: SpecConfig = SpecConfig(), stats: Stats | None = None,
             verifier: Verifier | None = None, record: bool = False) -> GenerationResult:
    """`stats`, when given, is filled in place as the loop runs (a streaming caller reads progress from it).
    `verifier` scores draft nodes (pruning; gate mode needs it); `record`: the result keeps every verified step."""
    sub = Submission(prompt_ids, cfg, eos_ids, spec, drafter, verifier, decode, record)
    return run_alone(target, sub, on_tokens, stats)


def run_alone(target, sub: Submission, on_tokens: OnTokens | None = None,
              stats: Stats | None = None) -> GenerationResult:
    """Run one request on a one-slot core sized for it; stream its tokens to `on_tokens` after each step (`stats`,
    when given, filled in place). The prompt runs in chunks of CoreConfig.prefill_tokens, as in a batch: logits of
    at most that many rows exist."""
    context = target.cfg.max_seq_len
    max_len = size_request(len(sub.prompt_ids), sub.cfg.max_new_tokens, sub.spec, context).room
    core = EngineCore(target, context, CoreConfig(slots=1, max_len=max_len))
    r = core.add(sub, stats)
    while not r.finished:
        core.step()
        new = r.take()
        if new and on_tokens is not None:
            on_tokens(new)
    if r.error is not None:  # alone, its failure is the caller's
        raise r.error
    return r.result()


def run_many(target, subs: Iterable[Submission], slots: int, max_len: int) -> Iterator[Request]:
    """Run submissions on one core, `slots` at a time (continuous batching: a finished request's slot takes the next
    at once); yields each one's Request when it finishes (its `sub` the submission), in finishing order. Submissions
    are taken from `subs` lazily."""
    core = EngineCore(target, target.cfg.max_seq_len, CoreConfig(slots=slots, max_len=max_len, max_queue=slots))
    pending = iter(subs)
    exhausted = False
    while True:
        while not exhausted and len(core.waiting) < slots:
            sub = next(pending, None)
            if sub is None:
                exhausted = True
            else:
                core.add(sub)
        if core.idle:
            return
        for r in core.step():
            if r.error is not None:  # as one request alone would: a caller of many reads results, not errors
                raise r.error
            yield r
