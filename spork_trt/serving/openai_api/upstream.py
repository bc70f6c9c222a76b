"""The gRPC stream to Triton's `spork` model (tritonclient.grpc.aio): a Job's token ids, sampling tensors and stop
strings in, pieces of text out, decoded from each response's token window exactly as the ensemble's postprocessing
does (the stop strings are cut here, by answer.py's StopFilter, not by the spork step's `cut_at`)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from spork_trt.io_spec import error_kind, model_step, request_arrays
from spork_trt.checkpoint.tokenizer import Tokenizer, text_delta
from spork_trt.serving.openai_api.errors import ApiError, unavailable
from spork_trt.serving.openai_api.params import Job
from spork_trt.spec.grammar import grammar_text
from spork_trt.spec.logprobs import TokenLogprob

MODEL = "spork"
SPORK_STEP = model_step(MODEL)


@dataclass
class Piece:
    """One response of the stream: the text it adds and everything known so far."""

    text: str
    ids: list[int]  # every token generated so far (EOS excluded)
    stats: dict[str, float]
    stop_reason: str  # "" until the final response: eos | max_tokens | stop_string
    final: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with the job's logprobs: one per new token


@dataclass
class Stream:
    """`async for piece in stream`; `cancel()` ends the gRPC call (Triton's spork model frees the slot at its next
    step)."""

    client: object  # tritonclient.grpc.aio.InferenceServerClient
    job: Job
    tok: Tokenizer
    ids: list[int] = field(default_factory=list)
    call: object = None
    finished: bool = False  # the final response arrived: Triton ends the call itself

    def cancel(self) -> None:
        if self.call is not None and not self.finished:
            self.call.cancel()

    async def __aiter__(self) -> AsyncIterator[Piece]:
        import grpc

        async def requests():
            yield {"model_name": MODEL, "inputs": inputs(self.job)}

        self.call = self.client.stream_infer(requests())
        try:
            async for result, error in self.call:
                if error is not None:  # the server ended the request: nothing to cancel (as our other clients;
                    self.finished = True  # docs/serving.md, known issues)
                    raise upstream_error(error.message())
                piece = self.piece(result)
                self.finished = piece.final
                yield piece
                if piece.final:
                    return
        except grpc.RpcError as e:  # Triton down, draining or refusing connections
            if e.code() == grpc.StatusCode.CANCELLED:
                raise
            raise unavailable(f"the model server is unavailable ({e.code().name}): retry later") from None
        finally:  # an answer cut short (a stop string, an error, the client gone): Triton frees its slot
            if not self.finished:
                self.cancel()

    def piece(self, result) -> Piece:
        window = [int(i) for i in result.as_numpy("output_ids").reshape(-1)]
        sent = int(result.as_numpy("sent_len").reshape(-1)[0])
        final = bool(result.as_numpy("final").reshape(-1)[0])
        self.ids.extend(window[sent:])
        stats = {k: float(result.as_numpy(k).reshape(-1)[0]) for k in
                 ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "mean_accepted_length",
                  "num_steps", "cached_tokens")}
        reason = result.as_numpy("stop_reason").reshape(-1)[0]
        return Piece(text_delta(self.tok, window, sent, final), self.ids, stats,
                     reason.decode() if isinstance(reason, bytes) else str(reason), final,
                     logprobs(result, window[sent:]))


def logprobs(result, new: list[int]) -> list[TokenLogprob]:
    """A response's io_spec.LOGPROB_OUTPUTS: [1, m], [1, m, k], [1, m, k] -> m TokenLogprob of its `new` tokens
    (none without)."""
    lp = result.as_numpy("output_logprobs").reshape(-1)  # [m]
    m = lp.shape[0]
    ids = result.as_numpy("top_logprob_ids").reshape(m, -1) if m else None  # [m, k]
    top = result.as_numpy("top_logprobs").reshape(m, -1) if m else None
    return [TokenLogprob(new[i], float(lp[i]), tuple((t, float(v)) for t, v in zip(ids[i].tolist(), top[i].tolist())
                                                     if t >= 0)) for i in range(m)]  # id -1: padding


def upstream_error(message: str) -> ApiError:
    """A Triton error response (a stream's error carries its message, not its code: io_spec.error_kind reads it):
    queue full or shutting down is a 503 to retry; a bad input the spork model refused (its message starts with the
    input's name: validation text, no internals) a 400 with that message; anything else the server's fault (its
    text stays in Triton's log, not in the response)."""
    kind = error_kind(message)
    if kind == "unavailable":
        return unavailable(f"the server is busy: {message}")
    if kind == "invalid":
        return ApiError(400, message, None, "invalid_value")
    return ApiError(500, "the model server failed this request: see its log", None, "upstream_error", "server_error")


def inputs(job: Job) -> list:
    """The `spork` model's tensors, each with the batch dim: [1, n] ids, [1, 1] settings."""
    import tritonclient.grpc.aio as grpcclient

    s = job.cfg.sampling
    values = request_arrays(SPORK_STEP, {
        "input_ids": job.prompt_ids, "max_tokens": job.cfg.max_new_tokens, "temperature": s.temperature,
        "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
        "stop_words": job.cfg.stop_strings or None,  # the engine core ends the request there too, freeing its slot
        "stream": True,  # always: stop strings and cancellation need it
        "spec_mode": job.spec_mode, "grammar": grammar_text(job.grammar) if job.grammar is not None else None,
        "logprobs": job.logprobs, "cache_scope": job.cache_scope or None})
    out = []
    for name, (arr, dtype) in values.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out
