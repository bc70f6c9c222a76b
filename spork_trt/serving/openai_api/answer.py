"""One answer: the upstream stream's text through the stop strings, then how it ended (finish reason, exact token
counts, the speculative stats). Streaming and non-streaming responses are both built from these events, so they
carry the same text."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from spork_trt.serving.openai_api.errors import ApiError
from spork_trt.serving.openai_api.stops import StopFilter, tokens_through_stop
from spork_trt.serving.openai_api.upstream import Stream
from spork_trt.spec.logprobs import TokenLogprob


@dataclass(frozen=True)
class Text:
    text: str  # never empty
    logprobs: tuple[TokenLogprob, ...] = ()  # with the job's logprobs: the tokens that arrived with it or before


@dataclass(frozen=True)
class End:
    finish_reason: str  # stop (EOS or a stop string) | length (max_tokens)
    completion_tokens: int
    stats: dict[str, float]
    logprobs: tuple[TokenLogprob, ...] = ()  # those no Text carried (the tokens of a stop string, held text)


async def answer(stream: Stream) -> AsyncIterator[Text | End]:
    """Text pieces, then one End. The engine core ends the request at a stop string itself (upstream sends them as
    stop_words) and holds back the tokens that could begin one; the filter cuts the text exactly where the stop
    string starts, and cancels the stream should it see one first. Logprobs ride with the text of their response,
    else with the next text; an answer's logprobs are one per completion token (a stop string's tokens counted)."""
    stops = stream.job.cfg.stop_strings
    filt, logs, given = StopFilter(stops), [], 0
    async for piece in stream:
        logs += piece.logprobs
        text = filt.feed(piece.text)
        if text:
            yield Text(text, tuple(logs))
            given, logs = given + len(logs), []
        if filt.stopped:  # the rest is not wanted: free the slot now
            stream.cancel()
            n = tokens_through_stop(piece.ids, stream.tok.decode, stops)
            yield End("stop", n, piece.stats, tuple(logs[:max(0, n - given)]))
            return
        if piece.final:
            rest = filt.flush()
            if rest:
                yield Text(rest, tuple(logs))
                logs = []
            # the server's deadline cut it short, like max_tokens: "length"
            yield End("length" if piece.stop_reason in ("max_tokens", "timeout") else "stop", len(piece.ids),
                      piece.stats, tuple(logs))
            return
    raise ApiError(502, "the model server ended the answer without its final response", None, "upstream_error",
                   "server_error")
