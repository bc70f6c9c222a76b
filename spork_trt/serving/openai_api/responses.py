"""OpenAI's response shapes: the whole answer, stream chunks, usage, and the speculative-decoding stats in the
extension field `metrics.speculative_decoding`."""
from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass

from spork_trt.checkpoint.tokenizer import Tokenizer
from spork_trt.serving.openai_api.params import CHAT
from spork_trt.spec.logprobs import TokenLogprob


@dataclass(frozen=True)
class Head:
    """What every response and chunk of one answer repeats."""

    kind: str  # params.CHAT | params.COMPLETION
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> Head:
        prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
        return cls(kind, prefix + secrets.token_hex(12), int(time.time()), model)

    def fields(self, chunk: bool = False) -> dict:
        kind = self.kind + (".chunk" if chunk and self.kind == CHAT else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int, stats: dict[str, float]) -> dict:
    """`stats`: the final response's; its cached_tokens are the prompt tokens whose KV rows were reused."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens", 0))}}


def metrics(stats: dict[str, float]) -> dict:
    return {"speculative_decoding": {
        "mean_accepted_length": stats.get("mean_accepted_length", 0.0),
        "acceptance_rate": stats.get("acceptance_rate", 0.0),
        "draft_tokens": int(stats.get("total_draft_tokens", 0)),
        "accepted_draft_tokens": int(stats.get("total_accepted_draft_tokens", 0)),
        "steps": int(stats.get("num_steps", 0))}}


def choice(head: Head, text: str | None, finish: str | None, chunk: bool, first: bool = False,
           logprobs: dict | None = None, index: int = 0, calls: list[dict] | None = None) -> dict:
    """`logprobs`: the tokens' (logprobs_field), None when not asked for; `index`: which of the n choices;
    `calls`: the answer read as tool calls (tools.read_calls): the message's tool_calls, its content null."""
    if head.kind != CHAT:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if not chunk:
        message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    delta = ({"role": "assistant", "content": text or ""} if first else {"content": text} if text else {})
    if calls:  # whole, in one chunk: the SDK's accumulator reads each call by its index
        delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def logprobs_field(kind: str, logs: tuple[TokenLogprob, ...], tok: Tokenizer, offset: int = 0) -> dict:
    """OpenAI's logprobs object for these tokens: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
    completions' {tokens, token_logprobs, top_logprobs, text_offset} (`offset`: characters of text before them).
    Alternatives a grammar forbids (probability 0) are left out."""
    def entry(t: int, v: float) -> dict:
        b = tok.token_bytes(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
    if kind == CHAT:
        return {"content": [entry(x.token, x.logprob) | {"top_logprobs": [entry(t, v) for t, v in x.top
                                                                          if v > -math.inf]} for x in logs]}
    tokens = [tok.token_bytes(x.token).decode("utf-8", "replace") for x in logs]
    offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in logs], "text_offset": offsets,
            "top_logprobs": [{tok.token_bytes(t).decode("utf-8", "replace"): v for t, v in x.top if v > -math.inf}
                             for x in logs]}


def whole(head: Head, choices: list[dict], use: dict, stats: dict) -> dict:
    """`choices`: choice(...) of each, by index; `stats`: the first choice's (its speculative metrics)."""
    return {**head.fields(), "choices": choices, "usage": use, "metrics": metrics(stats)}


def chunk(head: Head, text: str | None, finish: str | None = None, first: bool = False,
          with_usage: bool = False, logprobs: dict | None = None, index: int = 0, calls: list[dict] | None = None
          ) -> dict:
    out = {**head.fields(True), "choices": [choice(head, text, finish, True, first, logprobs, index, calls)]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(head: Head, use: dict, stats: dict) -> dict:
    return {**head.fields(True), "choices": [], "usage": use, "metrics": metrics(stats)}
