"""The routes: /v1/chat/completions, /v1/completions, /v1/models, /health. Every error is OpenAI's JSON shape; a
client that goes away cancels its gRPC stream (Triton's spork model frees the slot at its next step)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from spork_trt.checkpoint.tokenizer import Tokenizer
from spork_trt.serving.openai_api import responses as rs
from spork_trt.serving.openai_api.answer import End, answer
from spork_trt.serving.openai_api.choices import choice_jobs, copies, merged
from spork_trt.serving.openai_api.errors import ApiError, bad_request, too_large, unavailable
from spork_trt.serving.openai_api.gate import Gate, GateConfig, tenant
from spork_trt.serving.openai_api.model import ServedModel
from spork_trt.serving.openai_api.params import CHAT, COMPLETION, Job, parse_job
from spork_trt.serving.openai_api.schema import components, operation
from spork_trt.serving.openai_api.tools import Held, read_calls
from spork_trt.serving.openai_api.upstream import MODEL, Stream

log = logging.getLogger("spork_trt.serving.openai_api")
DISCONNECT_POLL_S = 0.5
MAX_PARSING = 64  # requests parsed (JSON, chat template, tokenizer) or waiting for it at once; more: 503


DRAIN_S, DRAIN_BYTES = 5.0, 64 * 2**20  # a refused body is read on and dropped for at most this long and this
# much, so that a client still sending it reads the 413 instead of a reset connection (which the OpenAI SDK sends
# again, twice)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass `limit` bytes: by its Content-Length, else while it
    streams in. Nothing past the limit is held; the rest is drained (DRAIN_S, DRAIN_BYTES) before the answer."""
    declared = request.headers.get("content-length", "")
    stream, chunks, size = request.stream(), [], 0
    if not (declared.isdigit() and int(declared) > limit):
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                break
            chunks.append(chunk)
        else:
            return b"".join(chunks)
    chunks.clear()
    await drain(stream, size)
    raise too_large(limit)


async def drain(stream, size: int) -> None:
    """Reads and drops the rest of a refused body, for at most DRAIN_S seconds and DRAIN_BYTES bytes."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for chunk in stream:
                size += len(chunk)
                if size > DRAIN_BYTES:
                    return
    except (TimeoutError, ClientDisconnect):
        pass


def parse(raw: bytes, kind: str, model: ServedModel, tenant_key: str):
    """The body -> a Job: JSON, then the fields, the template and the tokenizer (on the parsing thread)."""
    try:
        body = json.loads(raw)
    except ValueError:  # not JSON, not UTF-8, an integer literal past Python's 4,300 digits
        raise bad_request(None, "the request body is not valid JSON") from None
    except RecursionError:
        raise bad_request(None, "the request body nests arrays or objects too deeply") from None
    return parse_job(body, kind, model, tenant_key)


def create_app(model: ServedModel, grpc_url: str, max_body_bytes: int, gate: GateConfig = GateConfig()) -> FastAPI:
    state: dict = {"parsing": 0}
    # one thread parses every request, off the event loop (streams and /health go on meanwhile); one, because a
    # tokenizer is not safe to share between threads
    parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-parse")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        import tritonclient.grpc.aio as grpcclient

        state["client"] = grpcclient.InferenceServerClient(grpc_url)  # one channel, one stream per request
        yield
        await state["client"].close()
        parser.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="spork_trt OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    app.add_middleware(Gate, cfg=gate)  # keys, Host, Origin, JSON: before any route reads the body

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, e.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:  # unknown routes, wrong methods
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), None, None, kind).body(), e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ready = await state["client"].is_model_ready(MODEL)
        except Exception:  # noqa: BLE001 - any failure to ask means not ready
            ready = False
        return JSONResponse({"status": "ok" if ready else "unavailable"}, 200 if ready else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict:
        if name != model.name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {model.name!r}", "model",
                           "model_not_found")
        return model_card(model)

    @app.post("/v1/chat/completions", openapi_extra=operation(CHAT))
    async def chat(request: Request):
        return await complete(request, CHAT)

    @app.post("/v1/completions", openapi_extra=operation(COMPLETION))
    async def completions(request: Request):
        return await complete(request, COMPLETION)

    def openapi() -> dict:  # the routes' and the request models' schemas (schema.py)
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components())
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    async def complete(request: Request, kind: str):
        raw = await read_body(request, max_body_bytes)
        if state["parsing"] >= MAX_PARSING:
            raise unavailable(f"the server is busy: {MAX_PARSING} requests are being read")
        state["parsing"] += 1
        try:
            job = await asyncio.get_running_loop().run_in_executor(parser, parse, raw, kind, model,
                                                                   tenant(gate, request.headers))
        finally:
            state["parsing"] -= 1
        head = rs.Head.new(kind, model.name)
        jobs = choice_jobs(job)
        streams = [Stream(state["client"], j, model.tokenizer) for j in jobs]
        events = merged([answer(s) for s in streams], copies(job, jobs))  # (choice index, event)
        if not job.stream:
            try:
                return await until_disconnected(request, whole(head, events, job, model.tokenizer), streams)
            finally:  # one choice failed, or all ended: none is left running
                for s in streams:
                    s.cancel()
        first = await until_disconnected(request, anext(events), streams)  # errors before any byte: a JSON error
        return StreamingResponse(sse(head, first, events, streams, job, model.tokenizer),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def model_card(model: ServedModel) -> dict:
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "spork_trt",
            "context_window": model.context}


async def whole(head: rs.Head, events, job: Job, tok: Tokenizer) -> JSONResponse:
    """Every choice's text, finish and logprobs, by index; usage counts every choice's tokens (as OpenAI's)."""
    texts, logs, ends = [[] for _ in range(job.n)], [[] for _ in range(job.n)], [None] * job.n
    async for i, e in events:
        logs[i] += e.logprobs
        if isinstance(e, End):
            ends[i] = e
        else:
            texts[i].append(e.text)
    calls = [read_calls("".join(t), job.tools) if job.tools and job.tools.reads_calls else None for t in texts]
    choices = [rs.choice(head, "".join(texts[i]), "tool_calls" if calls[i] else e.finish_reason, False, index=i,
                         logprobs=None if job.logprobs is None else
                         rs.logprobs_field(head.kind, tuple(logs[i][:e.completion_tokens]), tok), calls=calls[i])
               for i, e in enumerate(ends)]
    use = rs.usage(len(job.prompt_ids), sum(e.completion_tokens for e in ends), ends[0].stats)
    return JSONResponse(rs.whole(head, choices, use, ends[0].stats))


async def sse(head: rs.Head, first, events, streams: list[Stream], job: Job, tok: Tokenizer):
    """Server-sent events, each choice's chunks by its index as they come; the generator is cancelled (closed) when
    the client goes away, which cancels the gRPC streams."""
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    include_usage, offsets, tokens = job.include_usage, [0] * job.n, 0
    held = [Held(job.tools) for _ in range(job.n)]  # text that may be a tool call waits for the answer's end

    def logs(i: int, these: tuple) -> dict | None:
        return None if job.logprobs is None else rs.logprobs_field(head.kind, these, tok, offsets[i])

    try:
        if head.kind == CHAT:  # the assistant's role first, as OpenAI streams it
            for i in range(job.n):
                yield data(rs.chunk(head, "", first=True, with_usage=include_usage, index=i))
        (i, e), ended = first, 0
        while True:
            if isinstance(e, End):
                rest, rest_logs, calls = held[i].end()
                if rest and not calls:
                    yield data(rs.chunk(head, rest, with_usage=include_usage, logprobs=logs(i, rest_logs), index=i))
                    offsets[i] += len(rest)
                elif calls:
                    yield data(rs.chunk(head, None, with_usage=include_usage, logprobs=logs(i, rest_logs), index=i,
                                        calls=calls))
                final = rs.chunk(head, None, "tool_calls" if calls else e.finish_reason, with_usage=include_usage,
                                 logprobs=logs(i, e.logprobs), index=i)
                final["metrics"] = rs.metrics(e.stats)
                yield data(final)
                ended, tokens = ended + 1, tokens + e.completion_tokens
                if ended == job.n:
                    if include_usage:
                        yield data(rs.usage_chunk(head, rs.usage(len(job.prompt_ids), tokens, e.stats), e.stats))
                    yield "data: [DONE]\n\n"
                    return
            else:
                text, these = held[i].feed(e.text, e.logprobs)
                if text:
                    yield data(rs.chunk(head, text, with_usage=include_usage, logprobs=logs(i, these), index=i))
                    offsets[i] += len(text)
            i, e = await anext(events)
    except ApiError as err:  # after the headers went out: the error as the stream's last event
        yield data(err.body())
    finally:
        for s in streams:
            s.cancel()


async def until_disconnected(request: Request, work, streams: list[Stream]):
    """Await `work`, cancelling it and the gRPC streams if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("client went away: cancelling its request")
                task.cancel()
                for s in streams:
                    s.cancel()
                raise ApiError(499, "the client closed the request", None, "client_closed")
    finally:
        if not task.done():
            task.cancel()
