"""What the Triton models do, without Triton: validate a request, hand it to the engine core that steps every
request together, stream chunks. `triton_repo/*/model.py` only convert tensors and errors; everything here is tested
directly.

A request's tensors arrive as numpy arrays with a batch dim of 1 (the models have max_batch_size > 0); an absent
optional input is None and means the default.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import io_spec
from .admission import size_request
from .config import GenerateConfig, SamplingConfig, SpecConfig
from .core import CoreConfig, EngineCore
from .request import Request
from .cost_model import ema
from .draft_kinds import AUTO_DRAFT, ENGINE, parse_draft
from .errors import FieldError, InternalError, QueueFull, UserError
from .io_spec import REQUEST_FIELDS, request_config
from .runtime import Runtime
from .stats import Stats

log = logging.getLogger("spork_trt.service")
SERVED_MODES = ("spork", "plain")
# tokens already sent that a response repeats before its new ones: enough to finish a multi-byte character split
# across tokens (at most 4 bytes, each token at least one) and to decode the new tokens as they read in context
DETOKENIZE_CONTEXT = 6  # the lossy gate mode is a local, opt-in experiment: never served

SHUTTING_DOWN = "the server is shutting down: retry on another instance"
LOOP_STOPPED = "the engine loop stopped (the server logged why): retry on another instance"

Inputs = Mapping[str, "np.ndarray | None"]


@dataclass(frozen=True)
class ServeRequest:
    prompt_ids: list[int]  # [n]
    cfg: GenerateConfig
    mode: str  # plain | spork
    stream: bool
    timeout_s: float  # the deadline: seconds from submission until the request is ended (stop_reason "timeout")


@dataclass(frozen=True)
class Chunk:
    """One response of the spork step."""

    output_ids: list[int]  # [n] the new tokens, after up to DETOKENIZE_CONTEXT already sent (a window)
    sent_len: int  # how many of output_ids earlier responses carried (postprocessing decodes the rest)
    final: bool
    stats: Stats
    stop_reason: str  # "" until final
    prompt_len: int  # the prompt's tokens
    cut_at: tuple[str, ...] = ()  # the request's stop strings, on the final response: its text ends at the first

    def tensors(self) -> dict[str, np.ndarray]:
        """Output tensors with the batch dim, named as in io_spec."""
        st = self.stats
        values = {"output_ids": np.array([self.output_ids], np.int32),  # [1, n]
                  "sent_len": np.array([[self.sent_len]], np.int32), "final": np.array([[self.final]], np.bool_),
                  "cut_at": np.array([[s.encode() for s in self.cut_at]], np.object_),  # [1, k]
                  "acceptance_rate": np.array([[st.acceptance_rate]], np.float32),
                  "total_accepted_draft_tokens": np.array([[st.accepted_tokens]], np.int32),
                  "total_draft_tokens": np.array([[st.draft_tokens]], np.int32),
                  "mean_accepted_length": np.array([[st.mean_accepted_length]], np.float32),
                  "num_steps": np.array([[st.steps]], np.int32),
                  "cached_tokens": np.array([[st.cached_tokens]], np.int32),
                  "stop_reason": np.array([[self.stop_reason.encode()]], np.object_),
                  "num_input_tokens": np.array([[self.prompt_len]], np.int32),
                  "num_output_tokens": np.array([[len(self.output_ids) - self.sent_len]], np.int32)}
        spork = next(s for s in io_spec.TRITON_STEPS if s.name == "spork")
        assert list(values) == [t.name for t in spork.outputs]
        return values


def scalar(inputs: Inputs, name: str, kind: type, default):
    """One value of an optional [1, 1] input; a clear error for any other shape."""
    arr = inputs.get(name)
    if arr is None:
        return default
    if arr.size != 1:
        raise UserError(f"{name} must hold one value per request, got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    if kind is str:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if kind is float:  # the shortest decimal of the FP32 value, as the client wrote it (the same value in fp32)
        return float(str(value))
    return kind(value)


def strings(inputs: Inputs, name: str) -> tuple[str, ...] | None:
    """The UTF-8 strings of an optional [1, n] STRING input."""
    arr = inputs.get(name)
    if arr is None:
        return None
    try:
        return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1))
    except UnicodeDecodeError as e:
        raise UserError(f"{name} must be UTF-8 text ({e.reason} at byte {e.start} of one)") from None


# the request's fields as the served models spell them: the tensors (the prompt arrives as text_input)
TENSOR_NAMES = {"prompt": io_spec.TEXT_INPUT.name} | {f.field: f.tensor.name for f in REQUEST_FIELDS if f.tensor}


def field_values(inputs: Inputs) -> tuple[dict[str, object], dict[str, str]]:
    """The request's values by config field (None: absent), and each field's name as this request spelled it:
    REQUEST_FIELDS' tensors, then io_spec.COMPAT_INPUTS (another name for one of them, a value accepted only at the
    one this server works at, or a flag that changes nothing here)."""
    values = {f.field: strings(inputs, f.tensor.name) if f.many else scalar(inputs, f.tensor.name, f.kind, None)
              for f in REQUEST_FIELDS if f.tensor}
    names = dict(TENSOR_NAMES)
    for c in io_spec.COMPAT_INPUTS:
        name = c.tensor.name
        value = scalar(inputs, name, c.tensor.kind, None)
        if value is None:
            continue
        if c.alias is not None:
            if values[c.alias] is not None:
                raise UserError(f"{name} and {names[c.alias]} name the same setting: send one of them")
            values[c.alias], names[c.alias] = value, name
        elif c.only is not None and value != c.only:
            raise UserError(f"{name}={value!r} is not supported by this server (only {name}={c.only!r}, or leave it "
                            "out)")
    return values, names


@dataclass(frozen=True)
class Limits:
    """What a served request must fit."""

    context: int  # positions a request may use: prompt + new tokens (its slot keeps one step's tree besides)
    vocab_size: int  # prompt ids are in [0, vocab_size)
    spec: SpecConfig = SpecConfig()
    timeout_s: float = 600.0  # a request's deadline: the default, and the most a request may ask for


def parse_request(inputs: Inputs, limits: Limits, can_stream: bool = True) -> ServeRequest:
    """Validate the spork step's inputs once, before the request is queued: the configs check their own fields,
    admission.size_request the lengths; every error names the tensor and the fix."""
    ids = np.asarray(inputs[io_spec.PROMPT_IDS.name]).reshape(-1)  # [n]
    bad = np.flatnonzero((ids < 0) | (ids >= limits.vocab_size))
    if bad.size:  # the ensemble's preprocessing never sends these; a client calling `spork` directly might
        raise UserError(f"input_ids must be token ids in [0, {limits.vocab_size}), got {ids[bad[0]]} at position "
                        f"{bad[0]}")
    prompt_ids = [int(i) for i in ids]
    values, names = field_values(inputs)
    cfg = request_config(values, lambda f: names[f.field])
    try:  # an absent max_tokens is the default clipped to what fits; one sent must fit
        size = size_request(len(prompt_ids), cfg.max_new_tokens, limits.spec, limits.context,
                            clip=values["max_new_tokens"] is None)
    except FieldError as e:
        raise e.named(TENSOR_NAMES[e.field]) from None
    mode = scalar(inputs, "spec_mode", str, "spork")
    if mode not in SERVED_MODES:
        raise UserError(f"unknown spec_mode {mode!r}: use one of {', '.join(SERVED_MODES)}")
    stream = bool(scalar(inputs, "stream", bool, False))
    if stream and not can_stream:
        raise UserError("stream=true needs the streaming model `ensemble`; `ensemble_unary` answers once")
    timeout = scalar(inputs, "timeout_s", float, limits.timeout_s)
    if not 0 < timeout <= limits.timeout_s:  # NaN too
        raise UserError(f"timeout_s must be in (0, {limits.timeout_s:g}] seconds (this server's longest), got {timeout}")
    return ServeRequest(prompt_ids, replace(cfg, max_new_tokens=size.max_new), mode, stream, timeout)


@dataclass(eq=False)
class Ticket:
    """One served request: the core's request plus how to answer it. `send` gets chunks, `fail` an exception (the
    final answer), `close` ends a cancelled stream; `cancelled` is polled once per step."""

    request: Request
    stream: bool
    send: Callable[[Chunk], None]
    fail: Callable[[BaseException], None]
    close: Callable[[], None]
    cancelled: Callable[[], bool]
    deadline: float = math.inf  # time.monotonic() at which the request is ended (stop_reason "timeout")
    expired: bool = False  # the deadline passed: it leaves the core, answered with what it generated
    generated: list[int] = field(default_factory=list)  # every token sent or to send
    sent: int = 0  # tokens the previous responses carried

    def chunk(self, final: bool, stats: Stats, stop_reason: str) -> Chunk | None:
        """The next response: the tokens since the last one, after DETOKENIZE_CONTEXT already sent (the text they
        add is decoded from this window alone, never the whole prefix). Until the final one, the tokens that could
        begin a stop string stay back (StopState.held); None when nothing is ready."""
        end = len(self.generated) - (0 if final else self.request.stop.held())
        if end <= self.sent and not final:
            return None
        start = max(0, self.sent - DETOKENIZE_CONTEXT)
        c = Chunk(self.generated[start:end], self.sent - start, final, stats, stop_reason,
                  len(self.request.prompt_ids), self.request.cfg.stop_strings if final else ())
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
        t.request.cancelled = True
        log.warning("spork: answering a request failed (%r); it leaves the batch", e)


@dataclass
class Metrics:
    """What the server exports (Prometheus gauges and counters, see triton_repo/spork/model.py)."""

    active: int = 0  # requests holding a slot
    queued: int = 0  # requests waiting for one
    batch_tokens: int = 0  # tokens of the last target forward (trees and prompt chunks)
    steps: int = 0  # engine core steps so far
    active_steps: int = 0  # requests in each step, summed over steps (mean batch size = active_steps / steps)
    generated_tokens: int = 0  # tokens committed, all requests
    draft_tokens: int = 0  # draft tokens verified, all finished requests
    accepted_tokens: int = 0  # draft tokens accepted, all finished requests
    tokens_per_second: float = 0.0  # committed tokens per second over the last steps (moving average)
    prefix_hits: int = 0  # requests admitted onto a finished request's KV rows (prefix_cache)
    prefix_reused_tokens: int = 0  # prompt tokens they did not prefill
    prefix_evictions: int = 0  # kept rows dropped to admit another request
    loop_up: int = 1  # 1 while the engine loop runs; 0 once it stopped (every request is then refused UNAVAILABLE)


class Service:
    """The spork step: one engine core over one KV pool, stepped by one thread; requests join the running batch
    between steps, leave when done or cancelled, and queue (bounded) while every slot is in use."""

    def __init__(self, runtime: Runtime, spec: SpecConfig, core: CoreConfig = CoreConfig(slots=8),
                 timeout_s: float = Limits.timeout_s) -> None:
        self.runtime, self.spec = runtime, spec
        # the context a request may use: the model's window, or less when the slots are smaller (they also keep
        # room for one step's tree)
        self.context = min(runtime.cfg.max_seq_len, core.max_len - spec.tree_room)
        if self.context < 2:
            raise UserError(f"KV slots of {core.max_len} positions leave no room for a request: raise max_len")
        self.limits = Limits(self.context, runtime.cfg.vocab_size, spec, timeout_s)
        self.core = EngineCore(runtime.engine, self.context, core)
        self.metrics = Metrics()
        self._inbox: list[Ticket] = []  # submitted, not yet handed to the core (the loop thread owns the core)
        self._tickets: dict[Request, Ticket] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._down: str | None = None  # why the loop stopped (None while it runs); set under _wake
        self._thread = threading.Thread(target=self._loop, name="spork-core", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, engines: Path, draft: str = AUTO_DRAFT,
             providers: tuple[str, ...] = ("CPUExecutionProvider",), core: CoreConfig = CoreConfig(slots=8),
             device: str | None = None, dtype: str = "bf16", verify: bool = False,
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
        request = self.runtime.request(req.prompt_ids, req.cfg, mode=req.mode, spec=self.spec)
        ticket = Ticket(request, req.stream, send, fail, close, cancelled, time.monotonic() + req.timeout_s)
        with self._wake:
            if self._down is not None or self._stopping:
                raise QueueFull(self._down or SHUTTING_DOWN)
            if len(self._inbox) + len(self.core.waiting) >= self.core.cfg.max_queue + len(self.core.pool.free):
                raise QueueFull(f"all {self.core.pool.slots} slots are in use and {self.core.cfg.max_queue} "
                                "requests wait for one (max_queue): retry later")
            self._inbox.append(ticket)
            self._wake.notify()
        return ticket

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
                try:
                    self._iterate(joining)
                except Exception as e:  # noqa: BLE001 - outside any one request's work: its step's requests fail
                    log.error("spork: an engine step failed; its requests fail, the waiting ones stay", exc_info=e)
                    self._answer(self.core.abort(e), 0.0)
        except BaseException as e:  # the loop is gone: say so, refuse everything from now on
            log.critical("spork: the engine loop stopped", exc_info=e)
        finally:
            self._stop()

    def _stop(self) -> None:
        """The loop's end: unhealthy from now on; every request not answered yet is answered UNAVAILABLE."""
        with self._wake:
            self._down = SHUTTING_DOWN if self._stopping else LOOP_STOPPED
            self.metrics.loop_up = 0
            pending, self._inbox, self._tickets = [*self._inbox, *self._tickets.values()], [], {}
        for t in pending:
            deliver(t, t.fail, QueueFull(self._down))

    def _iterate(self, joining: list[Ticket]) -> None:
        for t in joining:
            self._join(t)
        now = time.monotonic()
        for req, t in list(self._tickets.items()):
            t.expired = t.expired or now >= t.deadline
            try:
                req.cancelled = req.cancelled or t.expired or t.cancelled()
            except Exception as e:  # noqa: BLE001 - the transport's failure is this request's only
                req.cancelled = True
                log.warning("spork: request %s: checking its cancellation failed (%r); it leaves", req.id, e)
        t0 = time.perf_counter()
        finished = self.core.step()
        self._answer(finished, time.perf_counter() - t0)

    def _join(self, t: Ticket) -> None:
        try:
            self.core.add(t.request)
        except Exception as e:  # noqa: BLE001 - bad input, a full queue, or a bug: this request's answer
            deliver(t, t.fail, public_error(e, t.request.id))
            return
        self._tickets[t.request] = t

    def _answer(self, finished: list[Request], step_s: float) -> None:
        m, new_tokens = self.metrics, 0
        for req, t in list(self._tickets.items()):
            try:
                new_tokens += self._answer_one(req, t, req in finished)
            except Exception as e:  # noqa: BLE001 - answering this request failed: it fails alone
                self._tickets.pop(req, None)
                req.cancelled = True  # leaves the core at the next step, if it has not
                deliver(t, t.fail, public_error(e, req.id))
        m.active, m.queued, m.batch_tokens = len(self.core.active), len(self.core.waiting), self.core.batch_tokens
        m.steps += 1
        p = self.core.prefixes.stats
        m.prefix_hits, m.prefix_reused_tokens, m.prefix_evictions = p.hits, p.reused_tokens, p.evictions
        m.active_steps += len(self.core.active) + len(finished)
        m.generated_tokens += new_tokens
        m.tokens_per_second = ema(m.tokens_per_second or None, new_tokens / max(step_s, 1e-9))

    def _answer_one(self, req: Request, t: Ticket, finished: bool) -> int:
        """Send one request what this step gave it; returns its new tokens."""
        new = req.take()
        t.generated += new
        if req.error is not None:  # the core failed it alone and logged the detail under its id
            del self._tickets[req]
            deliver(t, t.fail, InternalError(req.id))
        elif finished:
            del self._tickets[req]
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
