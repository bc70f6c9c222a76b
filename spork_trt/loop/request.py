"""One request: the caller's part (`Submission`, frozen), the core's state of it (`Request`, what EngineCore.add
returns), its result, and the stop rule applied to what a step commits.

The caller builds a Submission and hands it to EngineCore.add, which returns the Request the core steps. The
caller keeps that Request to read from it after each step (`take()`, `finished`, `result()`, `stats`) and sets one
field of it, `cancelled`; the core never calls back into the caller."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.engines.kv_cache import Rows
from spork_trt.spec.logprobs import TokenLogprob, token_logprobs
from spork_trt.spec.scheduler import Scheduler
from spork_trt.loop.stats import Stats
from spork_trt.loop.stopping import StopState
from spork_trt.spec.tree import DraftTree
from spork_trt.spec.verifier import Scored, Verifier
from spork_trt.spec.verification import Verdict


@dataclass(frozen=True)
class Verified:
    """One target-verified step of a request that records them (calibration labels its nodes from these)."""

    tree: DraftTree  # the proposal
    scored: Scored | None  # the verifier's scores, None when it did not score
    verdict: Verdict  # over `tree`


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS excluded)
    stop_reason: str  # "eos" | "stop_string" | "max_tokens" | "cancelled" | "error"
    stats: Stats
    text: str | None = None  # set when a decode function was given
    verified: list[Verified] = field(default_factory=list)  # every verified step, when the request recorded them
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked for them


@dataclass(frozen=True, eq=False)
class Submission:
    """The caller's part of a request: what it asks for, never changed after submission (EngineCore.add builds the
    core's state of it, a Request). Compared by identity: two equal submissions are two requests."""

    prompt_ids: tuple[int, ...]  # [n]
    cfg: GenerateConfig
    eos_ids: frozenset[int] = frozenset()
    spec: SpecConfig = SpecConfig()
    drafter: object | None = None  # drafters.Drafter, this request's own (the core steps it); None: plain decoding
    verifier: Verifier | None = None  # scores draft nodes (pruning; gate mode needs it)
    # the tokenizer's detokenizer, a pure function of token ids -> text: the stop rule's stop strings and the
    # result's text read it (data the core applies, not a callback into the caller); None: no text
    decode: Callable[[list[int]], str] | None = None
    record: bool = False  # keep every verified step in the Request's `verified` (calibration)
    cache_scope: str = ""  # prefix reuse only among requests of the same scope (a tenant: prefix_cache.py)
    constraint: object | None = None  # grammar.Constraint, this request's own grammar state (the core advances it)
    logprobs: int | None = None  # each committed token's log-probability and this many alternatives (<= MAX_TOP)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names it in the logs (a client may quote it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))  # a caller's list, copied: never shared


@dataclass(eq=False)
class Request:
    """The core's state of one submitted request (EngineCore.add builds it). The caller reads it after each step
    (`take()`, `finished`, `result()`, `stats`) and sets `cancelled`; the core owns everything else."""

    sub: Submission  # what the caller asked for
    cancelled: bool = False  # the one field the caller sets: the request leaves at the next step, its slot freed
    stats: Stats = field(default_factory=Stats)  # filled in as the request runs
    outbox: list[int] = field(default_factory=list)  # committed tokens the caller has not taken yet
    logbox: list[TokenLogprob] = field(default_factory=list)  # with `logprobs`: the outbox's, one per token
    logs: list[TokenLogprob] = field(default_factory=list)  # with `logprobs`: every kept token's so far
    verified: list[Verified] = field(default_factory=list)  # with `record`: every target-verified step so far
    stop: StopState | None = None
    sched: Scheduler | None = None
    gen: torch.Generator | None = None
    slot: int | None = None
    cache: Rows | None = None  # its slot's KV rows in the pool (the target engine itself is stateless over them)
    room: int = 0  # positions the request may use: prompt + new tokens + a tree (admission.Size)
    prefilled: int = 0  # prompt tokens run so far
    root: int | None = None  # the last committed token, not yet run by the target (None while prefilling)
    # committed tokens before the root the target has not run yet: gate mode's, or a grammar's forced ones (their
    # rows are computed in the next forward, ahead of the tree)
    behind: list[int] = field(default_factory=list)
    t0: float = 0.0
    finished: bool = False
    error: Exception | None = None  # what failed this request alone (it left at the step it raised in)

    def take(self) -> list[int]:
        """Committed tokens since the last take."""
        out, self.outbox = self.outbox, []
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """With `logprobs`: the log-probabilities of the tokens the last take returned, one each."""
        out, self.logbox = self.logbox, []
        return out

    @property
    def can_score(self) -> bool:
        v = self.sub.verifier
        return v is not None and (v.head is not None or self.sub.spec.verifier == "on")

    def result(self) -> GenerationResult:
        reason = "error" if self.error is not None else \
            "cancelled" if self.cancelled and self.stop.reason is None else self.stop.reason
        text = self.stop.text() if self.sub.decode and self.stop.reason else None
        return GenerationResult(list(self.stop.tokens), reason, self.stats, text, self.verified,
                                list(self.logs) if self.sub.logprobs is not None else None)


def wants_hidden(r: Request) -> bool:
    """The request's drafter reads the target's hidden states (the learned draft head)."""
    return r.sub.drafter is not None and r.sub.drafter.wants_hidden


def emit(r: Request, committed: list[int], draft: int, accepted: int, gated: int = 0,
         rows: torch.Tensor | None = None, step: bool = True) -> None:
    """Apply the stop rule to a step's committed tokens, count the step (unless not `step`: forced tokens), put what
    is kept in the outbox. `rows` [len(committed), V]: the target's logits that predicted them (their
    log-probabilities, when asked for)."""
    kept = r.stop.add(committed)
    if kept:
        if step:
            r.stats.record_step(draft, accepted, gated)
        r.stats.committed_tokens += len(kept)
        r.outbox += kept
        if r.sub.logprobs is not None:
            logs = token_logprobs(rows[:len(kept)], kept, r.sub.logprobs)
            r.logbox += logs
            r.logs += logs
