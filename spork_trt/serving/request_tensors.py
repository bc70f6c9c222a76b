"""The spork step's tensors -> one validated ServeRequest, checked once before the request is queued (the Triton
edge of the request: io_spec's field table, the configs' own limits, admission's sizing, and the server's limits).

A request's tensors arrive as numpy arrays with a batch dim of 1 (the models have max_batch_size > 0); an absent
optional input is None and means the default.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from spork_trt import io_spec
from spork_trt.loop.admission import size_request
from spork_trt.serving.cancel_board import KEY
from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.errors import FieldError, UserError
from spork_trt.io_spec import REQUEST_FIELDS, request_config
from spork_trt.spec.grammar import GrammarSpec, parse_grammar
from spork_trt.spec.logprobs import MAX_TOP

Inputs = Mapping[str, "np.ndarray | None"]


@dataclass(frozen=True)
class ServeRequest:
    prompt_ids: list[int]  # [n]
    cfg: GenerateConfig
    mode: str  # plain | spork
    stream: bool
    timeout_s: float  # the deadline: seconds from submission until the request is ended (stop_reason "timeout")
    cancel_key: str | None = None  # a cancel carrying it ends the request (the unary models'; cancel_board.py)
    cache_scope: str = ""  # prefix reuse only among requests with the same one (prefix_cache.py)
    grammar: GrammarSpec | None = None  # what the output must match (spec/grammar.py)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (spec/logprobs.py)


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


def cancel_key(inputs: Inputs) -> str | None:
    """The optional cancel_key: io_spec.CANCEL_KEY_HEX lowercase hex digits (what the unary models make)."""
    key = scalar(inputs, io_spec.CANCEL_KEY.name, str, None)
    if key is not None and not KEY.fullmatch(key):
        raise UserError(f"cancel_key must be {io_spec.CANCEL_KEY_HEX} lowercase hex digits (a key the unary models "
                        "make for each request)")
    return key


def is_cancel(inputs: Inputs) -> bool:
    """A cancel, not a request: cancel_key without input_ids (a unary model's when its client cancels)."""
    return inputs.get(io_spec.PROMPT_IDS.name) is None and inputs.get(io_spec.CANCEL_KEY.name) is not None


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
    if inputs.get(io_spec.PROMPT_IDS.name) is None:
        raise UserError("input_ids is missing: send the prompt's token ids (or call the model `ensemble`, which "
                        "takes text_input)")
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
    if mode not in io_spec.SERVED_MODES:
        raise UserError(f"unknown spec_mode {mode!r}: use one of {', '.join(io_spec.SERVED_MODES)}")
    stream = bool(scalar(inputs, "stream", bool, False))
    if stream and not can_stream:
        raise UserError("stream=true needs the streaming model `ensemble`; `ensemble_unary` answers once")
    timeout = scalar(inputs, "timeout_s", float, limits.timeout_s)
    if not 0 < timeout <= limits.timeout_s:  # NaN too
        raise UserError(f"timeout_s must be in (0, {limits.timeout_s:g}] seconds (this server's longest), got {timeout}")
    scope = scalar(inputs, "cache_scope", str, "")
    if len(scope) > io_spec.MAX_CACHE_SCOPE:
        raise UserError(f"cache_scope must be at most {io_spec.MAX_CACHE_SCOPE} characters, got {len(scope)}")
    grammar = scalar(inputs, "grammar", str, None)
    if grammar is not None and len(grammar.encode()) > io_spec.MAX_GRAMMAR_BYTES:
        raise UserError(f"grammar must be at most {io_spec.MAX_GRAMMAR_BYTES} bytes, got {len(grammar.encode())}")
    logprobs = scalar(inputs, io_spec.LOGPROBS.name, int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP:
        raise UserError(f"logprobs must be 0 to {MAX_TOP} (alternatives per token), got {logprobs}")
    return ServeRequest(prompt_ids, replace(cfg, max_new_tokens=size.max_new), mode, stream, timeout,
                        cancel_key(inputs), scope, None if grammar is None else parse_grammar(grammar), logprobs)
