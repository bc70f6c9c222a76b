"""A request body -> one validated Job, checked once at the edge (DESIGN 8.7, 8.17): the sampling fields through
io_spec.request_config (the configs' own limits and messages, spelled as OpenAI spells the fields), the lengths
through admission.size_request; anything this server does not do is a 400 naming the field, never ignored."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from spork_trt.loop.admission import size_request
from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.errors import FieldError, UserError
from spork_trt.io_spec import MAX_GRAMMAR_BYTES, SERVED_MODES, request_config
from spork_trt.serving.openai_api.errors import ApiError, bad_request
from spork_trt.serving.openai_api.messages import messages, text_bytes, utf8
from spork_trt.serving.openai_api.model import ServedModel
from spork_trt.serving.openai_api.schema import CHAT, COMPLETION, checked
from spork_trt.serving.openai_api.tools import Tools, parse_tools
from spork_trt.spec.grammar import GrammarSpec

# accepted only at these values (OpenAI's defaults, or what this server always does); anything else is a 400
DEFAULT_ONLY: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "suffix": ("",),
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (True, False),
    "modalities": (["text"],), "store": (False,),
}
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}  # OpenAI -> config


@dataclass(frozen=True)
class Job:
    kind: str  # CHAT | COMPLETION (the response's `object`)
    prompt_ids: tuple[int, ...]  # [n]
    cfg: GenerateConfig  # max_new_tokens: what was asked for, else all that fits; stop_strings: `stop`
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    spec_mode: str = SERVED_MODES[0]  # extension, as the Triton input: spork or plain (the baseline, same text)
    cache_scope: str = ""  # prefix reuse only among requests of one tenant and cache_salt (cache_scope())
    grammar: GrammarSpec | None = None  # response_format's: what the output must match (spec/grammar.py)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: not asked for)
    n: int = 1  # choices (choices.py)
    tools: Tools | None = None  # tools and tool_choice (tools.py): the output read back as tool_calls


def cache_scope(tenant: str, salt: str | None) -> str:
    """The Triton `cache_scope` of a request: "" (shared by every request without a key or salt, as before), else a
    digest of its API key and `cache_salt` (vLLM's name for the field): never the key itself."""
    if not tenant and salt is None:
        return ""
    return hashlib.sha256(f"{tenant}\0{salt or ''}".encode()).hexdigest()


def parse_job(body: Any, kind: str, model: ServedModel, tenant: str = "") -> Job:
    """`tenant`: the API key the request was let in with ("" without keys): prefixes are reused within it only."""
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    checked(body, kind)  # each field's JSON type, the required ones, no unknown one (schema.py)
    for key, value in body.items():
        if key in DEFAULT_ONLY and value is not None:
            allowed = DEFAULT_ONLY[key]
            if value not in allowed or (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)):
                shown = f"{key}={value!r}" if isinstance(value, (bool, int, float, str)) else key
                raise bad_request(key, f"{shown} is not supported by this server (only {key}="
                                  f"{' or '.join(map(repr, allowed))}, or leave it out)", "unsupported_parameter")
    name = body["model"]
    if name != model.name:
        raise ApiError(404, f"the model {name!r} does not exist: this server serves {model.name!r}", "model",
                       "model_not_found")
    tools = parse_tools(body) if kind == CHAT else None
    if tools is not None and not model.tool_format:
        raise bad_request("tools", f"model {model.name}'s chat template has no tool format: start the server with "
                          "--chat-template generic (the project's generic tool format) or a template file of yours")
    texts = messages(body.get("messages"), bool(model.tool_format)) if kind == CHAT else prompt(body)
    fits_text(texts, model, "messages" if kind == CHAT else "prompt", tools)  # before templating or tokenizing
    ids = model.chat_ids(texts, tools) if kind == CHAT else model.prompt_ids(texts)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options", "stream_options must be {\"include_usage\": true|false}, with stream")
    include_usage = flag(options or {}, "include_usage")
    size_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_new_tokens": size_name, "stop_strings": "stop", **{v: k for k, v in SAMPLING.items()}}
    asked = body.get(size_name)
    values = {"max_new_tokens": asked, "stop_strings": stops(body.get("stop")),
              **{field: body.get(key) for key, field in SAMPLING.items()}}
    try:
        cfg = request_config(values, lambda f: names[f.field])
    except FieldError as e:  # already named as OpenAI spells the field
        raise bad_request(names[e.field], str(e)) from None
    param = "messages" if kind == CHAT else "prompt"
    try:  # no max_tokens: all that fits the context (the model stops at its end-of-turn token long before, mostly)
        size = size_request(len(ids), model.context if asked is None else asked, SpecConfig(), model.context,
                            clip=asked is None)
    except FieldError as e:
        name = param if e.field == "prompt" else size_name
        raise bad_request(name, str(e.named(name)), "context_length_exceeded") from None
    mode = body.get("spec_mode") or SERVED_MODES[0]
    if mode not in SERVED_MODES:
        raise bad_request("spec_mode", f"spec_mode must be one of {', '.join(SERVED_MODES)}, got {mode!r}")
    salt = body.get("cache_salt")
    grammar = response_format(body.get("response_format"), model)
    if tools is not None and tools.grammar is not None:
        if grammar is not None:
            raise bad_request("response_format", "response_format and a required or named tool_choice cannot both "
                              "hold the output: send one")
        grammar = compiled(tools.grammar, model, "tools")
    return Job(kind, tuple(ids), GenerateConfig(size.max_new, cfg.sampling, cfg.stop_strings), stream, include_usage,
               mode, cache_scope(tenant, salt), grammar, logprobs(body, kind), choices(body), tools)


def choices(body: dict) -> int:
    """n: 1 to MAX_N (schema.py)."""
    return body.get("n") or 1


def logprobs(body: dict, kind: str) -> int | None:
    """Alternatives per token, or None: chat's `logprobs` (true|false) and `top_logprobs` (0-20, with logprobs);
    completions' `logprobs` (0-5, the legacy field; null: none)."""
    if kind == COMPLETION:  # the ranges: schema.py (MAX_TOP_COMPLETION, MAX_TOP_CHAT)
        return body.get("logprobs")
    top = body.get("top_logprobs")
    if not flag(body, "logprobs"):
        if top:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


FORMATS = {"json_object": "json", "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}  # type -> kind


def response_format(value, model: ServedModel) -> GrammarSpec | None:
    """OpenAI's response_format ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}) and ours ({"type": "regex", "regex": TEXT}, {"type": "ebnf", "ebnf": TEXT}) -> the
    grammar the output must match, compiled once here so that a bad one is a 400 before any work."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None
    if kind not in FORMATS:
        raise bad_request("response_format", "response_format.type must be text, json_object, json_schema, or "
                          "this server's regex or ebnf")
    if kind == "json_object":
        source = ""
    elif kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request("response_format", 'response_format.json_schema must be {"name", "schema": {...}}')
        source = json.dumps(js.get("schema", {}))
    else:
        source = value.get(kind)
        if not isinstance(source, str) or not source.strip():
            raise bad_request("response_format", f"response_format.{kind} must be a non-empty string")
    if len(source.encode()) > MAX_GRAMMAR_BYTES:
        raise bad_request("response_format", f"response_format's grammar must be at most {MAX_GRAMMAR_BYTES} bytes")
    return compiled(GrammarSpec(FORMATS[kind], source), model, "response_format")


def compiled(spec: GrammarSpec, model: ServedModel, param: str) -> GrammarSpec:
    """`spec`, compiled once here (the compiler caches it for the spork model's turn): a bad one is a 400."""
    try:
        model.grammars.compiled(spec)
    except UserError as e:
        raise bad_request(param, str(e)) from None
    return spec


def fits_text(texts: list[dict] | str, model: ServedModel, param: str, tools: Tools | None = None) -> None:
    """Refuse text that cannot fit the context whatever it tokenizes to (ServedModel.max_text_bytes), by its size:
    the messages' (or the prompt's) and the tools' the template writes beside them."""
    size = len(texts.encode()) if isinstance(texts, str) else text_bytes(texts)
    size += len(json.dumps(tools.spec)) if tools is not None else 0
    if size > model.max_text_bytes:
        raise bad_request(param, f"{param} hold {size} bytes of text: no text over {model.max_text_bytes} bytes fits "
                          f"the model's context of {model.context} tokens; send less text", "context_length_exceeded")


def flag(body: dict, key: str) -> bool:
    """A true|false field (its type: schema.py); absent or null: false."""
    return bool(body.get(key))


def stops(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not 1 <= len(items) <= 4 or not all(isinstance(s, str) and s for s in items):
        raise bad_request("stop", f"stop must be a non-empty string or a list of 1 to 4 of them, got {value!r}")
    return tuple(items)


def prompt(body: dict) -> str:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # a batch of one
    if not isinstance(value, str) or not value.strip():
        raise bad_request("prompt", "prompt must be a non-empty string (one prompt per request)")
    return utf8(value, "prompt")
