"""Query the served `ensemble`: tritonclient HTTP or gRPC infer, gRPC bidirectional streaming, or Triton's HTTP
generate / generate_stream endpoints. Every protocol returns the same Reply.

A request that got no answer yet is sent again (`retries`, with exponential backoff and jitter) when the server
refused it as unavailable (a full queue, a draining or failed replica: errors.RETRY_HINTS, HTTP 503, gRPC
UNAVAILABLE) or its connection failed: behind a load balancer the next try reaches another replica. An answer cut
after its first response is never sent again (its text was already given out): it fails as incomplete."""
from __future__ import annotations

import http.client
import itertools
import json
import queue
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from spork_trt.config import GenerateConfig
from spork_trt.errors import Unanswered, UserError, retryable
from spork_trt.io_spec import ENSEMBLE_STEP, request_arrays

PROTOCOLS = ("http", "grpc", "generate")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "generate": 8000}
MODEL = "ensemble"  # decoupled: gRPC streaming, generate, generate_stream
UNARY_MODEL = "ensemble_unary"  # ModelInfer over HTTP and gRPC (Triton refuses it for a decoupled ensemble)
STAT_NAMES = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "mean_accepted_length",
              "num_steps")


@dataclass(frozen=True)
class ClientConfig:
    url: str | None = None  # host:port; None: 127.0.0.1 and the protocol's default port
    protocol: str = "grpc"  # http | grpc | generate
    stream: bool = False
    max_tokens: int = GenerateConfig.max_new_tokens  # the one default of every front end (config.py)
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_words: tuple[str, ...] = ()  # the answer ends where the first one starts
    spec_mode: str | None = None  # spork | plain; None: the server's default (spork)
    timeout_s: float = 600.0  # this client's own wait for the server
    deadline_s: float | None = None  # the server ends the request after this long (Triton input timeout_s)
    retries: int = 3  # times a request with no answer yet is sent again (see the module doc)
    backoff_s: float = 0.5  # before retry k (from 0): backoff_s * 2**k, plus up to half of it at random

    @property
    def address(self) -> str:
        return self.url or f"127.0.0.1:{DEFAULT_PORTS[self.protocol]}"


@dataclass
class Reply:
    text: str = ""
    stats: dict[str, float] = field(default_factory=dict)  # the STAT_NAMES of the last response
    stop_reason: str = ""
    chunks: int = 0  # responses received
    ttft_s: float = 0.0  # time to the first non-empty text
    time_s: float = 0.0
    start: float = 0.0  # time.perf_counter() when the request was sent
    # per response carrying stats: (seconds since `start`, tokens generated so far: steps x mean accepted length)
    progress: list[tuple[float, int]] = field(default_factory=list)
    retries: int = 0  # times the request was sent again before it was answered


OnText = Callable[[str], None]


def request_values(prompt: str, cfg: ClientConfig) -> dict[str, tuple[np.ndarray, str]]:
    """Input name -> (array with the batch dim, Triton dtype)."""
    if cfg.protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {cfg.protocol!r}")
    if cfg.stream and cfg.protocol == "http":
        raise UserError("HTTP infer cannot stream: use --protocol grpc or --protocol generate with --stream")
    return request_arrays(ENSEMBLE_STEP, {
        "text_input": prompt, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": cfg.stream,
        "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed, "stop_words": cfg.stop_words or None,
        "timeout_s": cfg.deadline_s, "spec_mode": cfg.spec_mode})


class Collector:
    """Accumulates responses (each a dict of output name -> value) into a Reply."""

    def __init__(self, on_text: OnText | None) -> None:
        self.reply, self.on_text, self.t0 = Reply(), on_text, time.perf_counter()
        self.reply.start = self.t0

    def add(self, out: dict) -> None:
        text = out["text_output"]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        if text and not self.reply.text:
            self.reply.ttft_s = time.perf_counter() - self.t0
        self.reply.text += text
        self.reply.chunks += 1
        self.reply.stats = st = {k: float(out[k]) for k in STAT_NAMES}
        self.reply.progress.append((time.perf_counter() - self.t0, round(st["num_steps"] * st["mean_accepted_length"])))
        reason = out.get("stop_reason", b"")
        self.reply.stop_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        if self.on_text and text:
            self.on_text(text)

    def done(self) -> Reply:
        self.reply.time_s = time.perf_counter() - self.t0
        return self.reply


def first(result, name: str):
    return result.as_numpy(name).reshape(-1)[0]


def query(prompt: str, cfg: ClientConfig = ClientConfig(), on_text: OnText | None = None) -> Reply:
    """Send one prompt; streamed text goes to `on_text` as it arrives. Server errors raise UserError; a request with
    no answer yet is sent again up to `cfg.retries` times (module doc)."""
    values = request_values(prompt, cfg)
    col = Collector(on_text)
    send = {"generate": generate_endpoint, "http": http_query, "grpc": grpc_query}[cfg.protocol]
    for attempt in itertools.count():
        try:
            send(values, cfg, col)
            break
        except Unanswered as e:
            if attempt >= cfg.retries:
                raise UserError(f"{e} (sent {attempt + 1} times)") from None
            time.sleep(cfg.backoff_s * 2 ** attempt * (1 + random.random() / 2))
    col.reply.retries = attempt
    return col.done()


def failure(message: str, col: Collector, retry: bool) -> UserError:
    """The error for a failed request: Unanswered (it may be sent again) when nothing was answered yet and `retry`;
    incomplete once a response came (never sent again)."""
    if col.reply.chunks:
        return UserError(f"{message}: the answer was cut after {col.reply.chunks} responses and is incomplete")
    return Unanswered(message) if retry else UserError(message)


def server_failure(e, col: Collector) -> UserError:
    """A tritonclient InferenceServerException: retried when it says unavailable (HTTP 503, gRPC UNAVAILABLE or our
    RETRY_HINTS)."""
    message = e.message() or str(e)
    retry = e.status() in ("503", "StatusCode.UNAVAILABLE") or retryable(message)
    return failure(f"server error: {message}", col, retry)


def http_query(values: dict, cfg: ClientConfig, col: Collector) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    try:
        with httpclient.InferenceServerClient(cfg.address, network_timeout=cfg.timeout_s) as c:
            inputs = [httpclient.InferInput(n, a.shape, dt) for n, (a, dt) in values.items()]
            for i, (a, _) in zip(inputs, values.values()):
                i.set_data_from_numpy(a)
            r = c.infer(UNARY_MODEL, inputs)
            col.add({n["name"]: first(r, n["name"]) for n in r.get_response()["outputs"]})
    except InferenceServerException as e:
        raise server_failure(e, col) from None
    except OSError as e:  # refused, reset or closed before the answer
        raise failure(f"cannot reach Triton at {cfg.address} ({e})", col, retry=True) from None


def grpc_query(values: dict, cfg: ClientConfig, col: Collector) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = [grpcclient.InferInput(n, a.shape, dt) for n, (a, dt) in values.items()]
    for i, (a, _) in zip(inputs, values.values()):
        i.set_data_from_numpy(a)
    try:
        with grpcclient.InferenceServerClient(cfg.address) as c:
            if not cfg.stream:
                r = c.infer(UNARY_MODEL, inputs, client_timeout=cfg.timeout_s)
                col.add({o.name: first(r, o.name) for o in r.get_response().outputs})
                return
            responses: queue.Queue = queue.Queue()
            c.start_stream(callback=lambda result, error: responses.put((result, error)),
                           stream_timeout=cfg.timeout_s)
            try:
                send_stream(c, inputs, responses)
                while True:
                    result, error = responses.get(timeout=cfg.timeout_s)
                    if error is not None:  # the server ended the request: nothing to cancel (cancelling a request
                        c.stop_stream()  # refused UNAVAILABLE left it held by Triton 2.51: docs/serving.md)
                        raise error
                    resp = result.get_response()
                    if resp.outputs:
                        col.add({o.name: first(result, o.name) for o in resp.outputs})
                    if resp.parameters["triton_final_response"].bool_param:
                        break
            except BaseException:  # the server's work on it ends too (Ctrl-C, an error, a timeout)
                c.stop_stream(cancel_requests=True)
                raise
            c.stop_stream()
    except InferenceServerException as e:
        raise server_failure(e, col) from None


def send_stream(c, inputs: list, responses: queue.Queue) -> None:
    """Send the request on a started stream. A stream that broke before (the server unreachable) refuses it with a
    generic message and has put the reason in `responses`: that is raised."""
    from tritonclient.utils import InferenceServerException

    try:
        c.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
    except InferenceServerException as e:
        try:
            _, error = responses.get(timeout=5.0)
        except queue.Empty:
            raise e from None
        raise error or e from None


def error_message(body: bytes, fallback: str) -> str:
    """The `error` of a generate endpoint's error body: JSON, or one server-sent event for generate_stream."""
    text = body.decode("utf-8", "replace").strip()
    text = text.removeprefix("data:")
    try:
        return json.loads(text).get("error", fallback)
    except (json.JSONDecodeError, AttributeError):
        return text or fallback


def generate_endpoint(values: dict, cfg: ClientConfig, col: Collector) -> None:
    """POST /v2/models/ensemble/generate (one JSON reply) or generate_stream (server-sent events); a tensor of n > 1
    values is a JSON list (Triton shapes it [1, n])."""
    def json_value(a: np.ndarray, dt: str):
        items = [x.decode() if dt == "BYTES" else x.item() for x in a.reshape(-1)]
        return items[0] if len(items) == 1 else items

    body = {n: json_value(a, dt) for n, (a, dt) in values.items()}
    path = "generate_stream" if cfg.stream else "generate"
    req = urllib.request.Request(f"http://{cfg.address}/v2/models/{MODEL}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as r:
            if not cfg.stream:
                col.add(json.loads(r.read()))
                return
            for line in r:
                line = line.strip()
                if line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise failure(f"server error: {event['error']}", col,
                                      retryable(event["error"]))
                    col.add(event)
            if not col.reply.stop_reason:  # the connection closed before the final event (a replica died)
                raise failure(f"the stream from Triton at {cfg.address} ended before its final response", col,
                              retry=True)
    except urllib.error.HTTPError as e:
        message = error_message(e.read(), e.reason)
        raise failure(f"server error (HTTP {e.code}): {message}", col,
                      e.code == 503 or retryable(message)) from None
    except urllib.error.URLError as e:
        raise failure(f"cannot reach Triton at {cfg.address} ({e.reason}): is `python -m spork_trt serve` running?",
                      col, retry=True) from None
    except (ConnectionError, http.client.HTTPException) as e:  # reset or closed: draining, or cut mid-stream
        raise failure(f"the connection to Triton at {cfg.address} was lost ({e!r})", col, retry=True) from None
