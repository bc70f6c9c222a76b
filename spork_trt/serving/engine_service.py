"""What the Triton models do, without Triton: validate a request (request_tensors.py), hand it to the engine core that
steps every request together, stream chunks (response_chunk.py: a response's tensors). `serving/triton_models/*/model.py`
only convert tensors and errors; everything here is tested directly."""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from spork_trt.serving.cancel_board import CancelBoard
from spork_trt.config import DEVICE_DTYPE, SamplingConfig, SpecConfig
from spork_trt.loop.engine_core import CoreConfig, EngineCore
from spork_trt.spec.cost_model import ema
from spork_trt.draft_kinds import AUTO_DRAFT, ENGINE, parse_draft
from spork_trt.errors import InternalError, QueueFull, UserError
from spork_trt.loop.request import Request, Submission
from spork_trt.loop.runtime import Runtime
from spork_trt.serving.request_tensors import Inputs, Limits, cancel_key, is_cancel, parse_request
from spork_trt.serving.response_chunk import Chunk
from spork_trt.loop.stats import Stats
from spork_trt.spec.logprobs import TokenLogprob

log = logging.getLogger("spork_trt.serving.engine_service")
# tokens already sent that a response repeats before its new ones: enough to finish a multi-byte character split
# across tokens (at most 4 bytes, each token at least one) and to decode the new tokens as they read in context
DETOKENIZE_CONTEXT = 6

SHUTTING_DOWN = "the server is shutting down: retry on another instance"
LOOP_STOPPED = "the engine loop stopped (the server logged why): retry on another instance"


@dataclass(eq=False)
class Ticket:
    """One served request: its submission, the core's request once the loop added it, and how to answer it. `send`
    gets chunks, `fail` an exception (the final answer), `close` ends a cancelled stream; `cancelled` is polled once
    per step, and so is the board for `key` (a cancel sent for it, to this instance or another)."""

    sub: Submission
    stream: bool
    send: Callable[[Chunk], None]
    fail: Callable[[BaseException], None]
    close: Callable[[], None]
    cancelled: Callable[[], bool]
    deadline: float = math.inf  # time.monotonic() at which the request is ended (stop_reason "timeout")
    key: str | None = None  # its cancel_key (the unary models' requests)
    expired: bool = False  # the deadline passed: it leaves the core, answered with what it generated
    generated: list[int] = field(default_factory=list)  # every token sent or to send
    logs: list[TokenLogprob] = field(default_factory=list)  # with logprobs: one per token of `generated`
    sent: int = 0  # tokens the previous responses carried
    request: Request | None = None  # the core's state of `sub` (EngineCore.add, on the loop's thread); None before

    def chunk(self, final: bool, stats: Stats, stop_reason: str) -> Chunk | None:
        """The next response: the tokens since the last one, after DETOKENIZE_CONTEXT already sent (the text they
        add is decoded from this window alone, never the whole prefix). Until the final one, the tokens that could
        begin a stop string stay back (StopState.held); None when nothing is ready."""
        end = len(self.generated) - (0 if final else self.request.stop.held())
        if end <= self.sent and not final:
            return None
        start = max(0, self.sent - DETOKENIZE_CONTEXT)
        c = Chunk(self.generated[start:end], self.sent - start, final, stats, stop_reason,
                  len(self.sub.prompt_ids), self.sub.cfg.stop_strings if final else (),
                  tuple(self.logs[self.sent:end]), self.sub.logprobs or 0)
        self.sent = end
        return c


def public_error(e: BaseException, request_id: str | None = None) -> Exception:
    """What a client may see of `e`: bad input and a full (or stopped) server as they are; anything else is logged
    here with its detail and answered as an InternalError naming only the request's id."""
    if isinstance(e, (UserError, QueueFull, InternalError)):
        return e
    request_id = request_id or uuid.uuid4().hex[:12]
    log.error("spork: request %s failed", request_id, exc_info=e)
    return InternalError(request_id)


def deliver(t: Ticket, fn: Callable, *args) -> None:
    """Answer through the transport; if it fails (the client is gone), the request leaves at the next step and the
    loop goes on."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the transport's failure is this request's only
        if t.request is not None:  # not yet in the core: nothing to leave
            t.request.cancelled = True
        log.warning("spork: answering a request failed (%r); it leaves the batch", e)


@dataclass
class Metrics:
    """What the server exports (Prometheus gauges and counters, see spork_trt/serving/triton_models/spork/model.py)."""

    active: int = 0  # requests holding a slot
    queued: int = 0  # requests waiting for one
    batch_tokens: int = 0  # tokens of the last target forward (trees and prompt chunks)
    steps: int = 0  # engine core steps so far
    active_steps: int = 0  # requests in each step, summed over steps (mean batch size = active_steps / steps)
    generated_tokens: int = 0  # tokens committed, all requests
    draft_tokens: int = 0  # draft tokens verified, all finished requests
    accepted_tokens: int = 0  # draft tokens accepted, all finished requests
    tokens_per_second: float = 0.0  # committed tokens per second over the last steps (moving average)
    prefix_hits: int = 0  # requests admitted onto a finished (or running) request's KV rows (prefix_cache)
    prefix_reused_tokens: int = 0  # prompt tokens they did not prefill
    prefix_evictions: int = 0  # kept rows dropped to admit another request
    prefix_shared: int = 0  # of the hits, requests whose rows were copied from a running request
    loop_up: int = 1  # 1 while the engine loop runs; 0 once it stopped (every request is then refused UNAVAILABLE)


class Service:
    """The spork step: one engine core over one KV pool, stepped by one thread; requests join the running batch
    between steps, leave when done or cancelled, and queue (bounded) while every slot is in use."""

    def __init__(self, runtime: Runtime, spec: SpecConfig, core: CoreConfig = CoreConfig(slots=8),
                 timeout_s: float = Limits.timeout_s, board: CancelBoard | None = None) -> None:
        self.runtime, self.spec = runtime, spec
        # the context a request may use: the model's window, or less when the slots are smaller (they also keep
        # room for one step's tree)
        self.context = min(runtime.cfg.max_seq_len, core.max_len - spec.tree_room)
        if self.context < 2:
            raise UserError(f"KV slots of {core.max_len} positions leave no room for a request: raise max_len")
        self.limits = Limits(self.context, runtime.cfg.vocab_size, spec, timeout_s)
        self.core = EngineCore(runtime.engine, self.context, core)
        self.metrics = Metrics()
        self.board = board or CancelBoard.default()  # cancels by key, from any instance (cancel_board.py)
        self._inbox: list[Ticket] = []  # submitted, not yet handed to the core (the loop thread owns the core)
        self._tickets: dict[Request, Ticket] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._down: str | None = None  # why the loop stopped (None while it runs); set under _wake
        self._step_since: float | None = None  # when the running iteration began (monotonic); None between them
        self._thread = threading.Thread(target=self._loop, name="spork-core", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, engines: Path, draft: str = AUTO_DRAFT,
             providers: tuple[str, ...] = ("CPUExecutionProvider",), core: CoreConfig = CoreConfig(slots=8),
             device: str | None = None, dtype: str = DEVICE_DTYPE, verify: bool = False,
             timeout_s: float = Limits.timeout_s) -> Service:
        """`device` (cuda): the target on the device engine (Runtime.from_engines), in `dtype`; `verify`: check every
        artifact's sha256 first (sizes are always checked); `timeout_s`: a request's default and longest deadline."""
        rt = Runtime.from_engines(engines, providers, device=device, dtype=dtype, verify=verify)
        spec = rt.resolve(SpecConfig.for_draft(draft))
        draft = parse_draft(spec.draft, rt.cfg.n_layers)
        if ENGINE in draft.kind.needs:
            rt.draft_engine(draft)  # load it now, not on the first request
        else:  # a build without its datastore or head (or a part's engine) fails now, in one line
            rt.drafter(draft, SamplingConfig())
        return cls(rt, spec, core, timeout_s)

    @property
    def healthy(self) -> bool:
        """The engine loop runs: requests are served. False once it stopped (shut down, or died): every request
        is refused UNAVAILABLE at once."""
        with self._wake:
            return self._down is None

    def stalled(self, bound_s: float) -> str | None:
        """Why the loop no longer serves, if it does not: it stopped, or one iteration has run past `bound_s`
        (watchdog.py). A stalled loop is marked down: new requests are refused at once, waiting ones answered."""
        with self._wake:
            if self._down is not None:
                return self._down
            since = self._step_since
        if not self._thread.is_alive():
            return LOOP_STOPPED
        if since is not None and time.monotonic() - since > bound_s:
            self._stop(f"an engine step has run for over {bound_s:g}s (stalled): retry on another instance")
            return self._down
        return None

    @property
    def active(self) -> int:
        """Requests submitted and not yet answered."""
        with self._wake:
            return len(self._inbox) + len(self._tickets)

    def submit(self, inputs: Inputs, send: Callable[[Chunk], None], fail: Callable[[BaseException], None],
               close: Callable[[], None] = lambda: None, cancelled: Callable[[], bool] = lambda: False,
               can_stream: bool = True) -> Ticket:
        """Queue one request; its answers go to `send` (one chunk, or a stream ending with a final one) or `fail`.
        Raises UserError for bad input and QueueFull when every slot is taken and the queue is full, before any
        work."""
        req = parse_request(inputs, self.limits, can_stream)
        sub = self.runtime.request(req.prompt_ids, req.cfg, mode=req.mode, spec=self.spec, cache_scope=req.cache_scope,
                                   grammar=req.grammar, logprobs=req.logprobs)
        ticket = Ticket(sub, req.stream, send, fail, close, cancelled, time.monotonic() + req.timeout_s,
                        req.cancel_key)
        with self._wake:
            if self._down is not None or self._stopping:
                raise QueueFull(self._down or SHUTTING_DOWN)
            if len(self._inbox) + len(self.core.waiting) >= self.core.cfg.max_queue + len(self.core.pool.free):
                raise QueueFull(f"all {self.core.pool.slots} slots are in use and {self.core.cfg.max_queue} "
                                "requests wait for one (max_queue): retry later")
            self._inbox.append(ticket)
            self._wake.notify()
        return ticket

    def control(self, inputs: Inputs) -> bool:
        """A cancel (request_tensors.is_cancel: cancel_key alone) is acted on here: the request carrying that key, on
        this instance or another, leaves at its next step (a key no request carries is swept later). False for a
        request: submit it."""
        if not is_cancel(inputs):
            return False
        self.board.post(cancel_key(inputs))
        return True

    def run(self, inputs: Inputs, send: Callable[[Chunk], None], cancelled: Callable[[], bool] = lambda: False,
            can_stream: bool = True) -> bool:
        """Serve one request and wait for it: False if it was cancelled (nothing more sent). Raises UserError for
        bad input, and the request's own error if it failed."""
        done, outcome = threading.Event(), {}

        def finish(**kw):
            outcome.update(kw)
            done.set()

        def on_chunk(chunk: Chunk) -> None:
            send(chunk)
            if chunk.final:
                finish(ok=True)

        self.submit(inputs, on_chunk, lambda e: finish(error=e), lambda: finish(ok=False), cancelled, can_stream)
        done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["ok"]

    def close(self) -> None:
        """Stop the loop; every request not answered yet gets an error (the loop's last act)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        """Step the core until closed. One iteration that raises fails the requests of its step (not the waiting
        ones) and the loop goes on; if the loop stops anyway, the service turns unhealthy and answers everything."""
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._inbox and self.core.idle:
                        self._wake.wait()
                    if self._stopping:
                        return
                    joining, self._inbox = self._inbox, []
                self._step_since = time.monotonic()  # the watchdog's clock (stalled)
                try:
                    self._iterate(joining)
                except Exception as e:  # noqa: BLE001 - outside any one request's work: its step's requests fail
                    log.error("spork: an engine step failed; its requests fail, the waiting ones stay", exc_info=e)
                    self._answer(self.core.abort(e), 0.0)
                self._step_since = None
        except BaseException as e:  # the loop is gone: say so, refuse everything from now on
            log.critical("spork: the engine loop stopped", exc_info=e)
        finally:
            self._stop()

    def _stop(self, why: str | None = None) -> None:
        """The loop's end (or its stall: `why`): unhealthy from now on; every request not answered yet is answered
        UNAVAILABLE."""
        with self._wake:
            if self._down is not None and why is not None:  # already down
                return
            self._down = why or (SHUTTING_DOWN if self._stopping else LOOP_STOPPED)
            self.metrics.loop_up = 0
            pending, self._inbox, self._tickets = [*self._inbox, *self._tickets.values()], [], {}
        for t in pending:
            self._forget(t)
            deliver(t, t.fail, QueueFull(self._down))

    def _iterate(self, joining: list[Ticket]) -> None:
        for t in joining:
            self._join(t)
        now = time.monotonic()
        for req, t in list(self._tickets.items()):
            t.expired = t.expired or now >= t.deadline
            try:
                why = None if req.cancelled else self._leaving(t)
                if why:
                    req.cancelled = True
                    log.info("spork: request %s leaves: %s", req.sub.id, why)
            except Exception as e:  # noqa: BLE001 - the transport's failure is this request's only
                req.cancelled = True
                log.warning("spork: request %s: checking its cancellation failed (%r); it leaves", req.sub.id, e)
        t0 = time.perf_counter()
        finished = self.core.step()
        self._answer(finished, time.perf_counter() - t0)

    def _leaving(self, t: Ticket) -> str | None:
        """Why a request in the core must leave now, if it must."""
        if t.expired:
            return "its deadline"
        if t.cancelled():
            return "its client cancelled"
        if t.key is not None and self.board.posted(t.key):
            return "its key was posted"
        return None

    def _join(self, t: Ticket) -> None:
        try:
            t.request = self.core.add(t.sub)
        except Exception as e:  # noqa: BLE001 - bad input, a full queue, or a bug: this request's answer
            self._forget(t)
            deliver(t, t.fail, public_error(e, t.sub.id))
            return
        self._tickets[t.request] = t
        if t.key is not None:
            try:
                self.board.serving(t.key)  # a cancel of it is taken however many made-up keys wait (cancel_board.py)
            except OSError as e:  # its cancel is then taken while the board has room, as before
                log.warning("spork: request %s: marking its cancel key running failed (%r)", t.sub.id, e)

    def _end(self, req: Request) -> None:
        """`req` is answered (or failed): its ticket leaves, its key with it."""
        t = self._tickets.pop(req, None)
        if t is not None:
            self._forget(t)

    def _forget(self, t: Ticket) -> None:
        if t.key is not None:
            try:
                self.board.clear(t.key)
            except OSError as e:  # the key stays until swept; the request is answered all the same
                log.warning("spork: request %s: taking its cancel key off the board failed (%r)", t.sub.id, e)

    def _answer(self, finished: list[Request], step_s: float) -> None:
        m, new_tokens = self.metrics, 0
        for req, t in list(self._tickets.items()):
            try:
                new_tokens += self._answer_one(req, t, req in finished)
            except Exception as e:  # noqa: BLE001 - answering this request failed: it fails alone
                self._end(req)
                req.cancelled = True  # leaves the core at the next step, if it has not
                deliver(t, t.fail, public_error(e, req.sub.id))
        m.active, m.queued, m.batch_tokens = len(self.core.active), len(self.core.waiting), self.core.batch_tokens
        m.steps += 1
        p = self.core.prefixes.stats
        m.prefix_hits, m.prefix_reused_tokens, m.prefix_evictions, m.prefix_shared = p.hits, p.reused_tokens, \
            p.evictions, p.shared
        m.active_steps += len(self.core.active) + len(finished)
        m.generated_tokens += new_tokens
        m.tokens_per_second = ema(m.tokens_per_second or None, new_tokens / max(step_s, 1e-9))

    def _answer_one(self, req: Request, t: Ticket, finished: bool) -> int:
        """Send one request what this step gave it; returns its new tokens."""
        new = req.take()
        t.generated += new
        t.logs += req.take_logprobs()
        if req.error is not None:  # the core failed it alone and logged the detail under its id
            self._end(req)
            deliver(t, t.fail, InternalError(req.sub.id))
        elif finished:
            self._end(req)
            self.metrics.draft_tokens += req.stats.draft_tokens
            self.metrics.accepted_tokens += req.stats.accepted_tokens
            res = req.result()
            if t.expired:  # its deadline: what it generated, as a finished answer
                deliver(t, t.send, t.chunk(True, req.stats, "timeout"))
            elif res.stop_reason == "cancelled":
                deliver(t, t.close)
            else:
                deliver(t, t.send, t.chunk(True, req.stats, res.stop_reason))
        elif t.stream and new and (chunk := t.chunk(False, req.stats, "")) is not None:
            deliver(t, t.send, chunk)
        return len(new)
