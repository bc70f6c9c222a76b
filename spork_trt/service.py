"""What the Triton models do, without Triton: validate a request, run the loop on the request's own KV caches,
stream chunks. `triton_repo/*/model.py` only convert tensors and errors; everything here is tested directly.

A request's tensors arrive as numpy arrays with a batch dim of 1 (the models have max_batch_size > 0); an absent
optional input is None and means the default.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import io_spec
from .config import GenerateConfig, SamplingConfig, SpecConfig
from .errors import UserError
from .runtime import Runtime
from .stats import Stats
from .tokenizer import Tokenizer, load_tokenizer, text_delta

SERVED_MODES = ("spork", "plain")  # the lossy gate mode is a local, opt-in experiment: never served

Inputs = Mapping[str, "np.ndarray | None"]


class Cancelled(Exception):
    """The client cancelled the request or went away."""


@dataclass(frozen=True)
class ServeRequest:
    prompt_ids: list[int]  # [n]
    cfg: GenerateConfig
    mode: str  # plain | spork
    stream: bool


@dataclass(frozen=True)
class Chunk:
    """One response of the spork step."""

    output_ids: list[int]  # [n] every token generated so far (postprocessing decodes the delta)
    sent_len: int  # tokens the previous response carried
    final: bool
    stats: Stats
    stop_reason: str  # "" until final

    def tensors(self) -> dict[str, np.ndarray]:
        """Output tensors with the batch dim, named as in io_spec."""
        st = self.stats
        values = {"output_ids": np.array([self.output_ids], np.int32),  # [1, n]
                  "sent_len": np.array([[self.sent_len]], np.int32), "final": np.array([[self.final]], np.bool_),
                  "acceptance_rate": np.array([[st.acceptance_rate]], np.float32),
                  "total_accepted_draft_tokens": np.array([[st.accepted_tokens]], np.int32),
                  "total_draft_tokens": np.array([[st.draft_tokens]], np.int32),
                  "mean_accepted_length": np.array([[st.mean_accepted_length]], np.float32),
                  "num_steps": np.array([[st.steps]], np.int32),
                  "stop_reason": np.array([[self.stop_reason.encode()]], np.object_)}
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
    return kind(value)


def parse_request(inputs: Inputs, context: int, can_stream: bool = True) -> ServeRequest:
    """Validate the spork step's inputs once; every error names the field and the fix."""
    ids = inputs["input_ids"]
    prompt_ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if not prompt_ids:
        raise UserError("text_input encodes to no tokens: send some text")
    room = context - len(prompt_ids)
    if room <= 0:
        raise UserError(f"text_input has {len(prompt_ids)} tokens but the context window is {context}: shorten it")
    max_tokens = scalar(inputs, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = min(GenerateConfig.max_new_tokens, room)  # the default, clipped to what fits
    if max_tokens <= 0:
        raise UserError(f"max_tokens must be a positive number of tokens, got {max_tokens}")
    if max_tokens > room:
        raise UserError(f"max_tokens {max_tokens} is beyond the context: the prompt has {len(prompt_ids)} tokens "
                        f"and the context window is {context}, so at most {room} new tokens fit")
    temperature = scalar(inputs, "temperature", float, SamplingConfig.temperature)
    if not temperature >= 0:
        raise UserError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    top_p = scalar(inputs, "top_p", float, SamplingConfig.top_p)
    if not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    top_k = scalar(inputs, "top_k", int, SamplingConfig.top_k)
    if top_k < 0:
        raise UserError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    seed = scalar(inputs, "seed", int, None)
    mode = scalar(inputs, "spec_mode", str, "spork")
    if mode not in SERVED_MODES:
        raise UserError(f"unknown spec_mode {mode!r}: use one of {', '.join(SERVED_MODES)}")
    stream = bool(scalar(inputs, "stream", bool, False))
    if stream and not can_stream:
        raise UserError("stream=true needs the streaming model `ensemble`; `ensemble_unary` answers once")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return ServeRequest(prompt_ids, GenerateConfig(max_new_tokens=max_tokens, sampling=sampling), mode, stream)


def encode_text(tok: Tokenizer, text_input: np.ndarray) -> np.ndarray:
    """Preprocessing: text_input [1, 1] (bytes) -> input_ids [1, n] through the chat template."""
    if text_input.size != 1:
        raise UserError(f"text_input must hold one string per request, got shape {list(text_input.shape)}")
    raw = text_input.reshape(-1)[0]
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as e:
        raise UserError(f"text_input is not valid UTF-8 ({e.reason} at byte {e.start}): send UTF-8 text") from None
    if not text.strip():
        raise UserError("text_input is empty: send some text to generate from")
    return np.array([tok.encode_prompt(text)], np.int32)


def decode_chunk(tok: Tokenizer, output_ids: np.ndarray, sent_len: np.ndarray, final: np.ndarray) -> np.ndarray:
    """Postprocessing: the text this response adds -> text_output [1, 1] (UTF-8 bytes)."""
    ids = [int(i) for i in output_ids.reshape(-1)]
    delta = text_delta(tok, ids, int(sent_len.reshape(-1)[0]), bool(final.reshape(-1)[0]))
    return np.array([[delta.encode("utf-8")]], np.object_)


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """A Triton python model's `initialize` args -> its config parameters, with `engines` resolved to a path
    (a relative one is relative to the repository root)."""
    import json

    params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
    p = Path(params["engines"])
    params["engines"] = str(p if p.is_absolute() else (Path(args["model_repository"]).parent / p).resolve())
    return params


def model_tokenizer(args: Mapping[str, str]) -> Tokenizer:
    """The tokenizer of the engines a Triton python model's config names."""
    from .export import manifest as mf

    engines = Path(model_parameters(args)["engines"])
    cfg = mf.spec_config(mf.read(engines)["model"])
    return load_tokenizer(engines, "hf", cfg.eos_token_ids)


class Service:
    """The spork step: one shared runtime (weights, sessions); per request a fork with its own caches."""

    def __init__(self, runtime: Runtime, spec: SpecConfig, spec_max_active: int = 0) -> None:
        self.runtime, self.spec = runtime, spec
        self.spec_max_active = spec_max_active  # speculate while at most this many requests run; 0: always
        self.active = 0  # requests in flight
        self._lock = threading.Lock()

    @classmethod
    def load(cls, engines: Path, draft: str = SpecConfig.draft,
             providers: tuple[str, ...] = ("CPUExecutionProvider",), spec_max_active: int = 0) -> Service:
        rt = Runtime.from_engines(engines, providers)
        spec = SpecConfig.for_draft(draft)
        if spec.draft not in ("ngram", "hybrid"):
            rt.draft_engine(spec.draft)  # load it now, not on the first request
        return cls(rt, spec, spec_max_active)

    def busy(self) -> bool:
        """More requests in flight than speculation pays for: the compute is taken (plain steps meanwhile)."""
        return self.active > self.spec_max_active

    def run(self, inputs: Inputs, send: Callable[[Chunk], None], cancelled: Callable[[], bool] = lambda: False,
            can_stream: bool = True) -> bool:
        """Serve one request: chunks go to `send` (one, or a stream ending with a final one). Returns False if
        the request was cancelled (nothing more is sent); raises UserError for bad input before any work."""
        req = parse_request(inputs, self.runtime.cfg.max_seq_len, can_stream)
        rt, stats = self.runtime.fork(), Stats()  # stats fill in as the loop runs
        generated: list[int] = []
        sent = 0

        def on_tokens(new: list[int]) -> None:
            nonlocal sent
            if cancelled():
                raise Cancelled
            generated.extend(new)
            if req.stream:
                send(Chunk(list(generated), sent, False, stats, ""))
                sent = len(generated)

        with self._lock:
            self.active += 1
        try:
            result = rt.generate(req.prompt_ids, req.cfg, mode=req.mode, spec=self.spec, on_tokens=on_tokens,
                                 stats=stats, busy=self.busy if self.spec_max_active else None)
        except Cancelled:
            return False
        finally:
            with self._lock:
                self.active -= 1
        send(Chunk(result.token_ids, sent, True, result.stats, result.stop_reason))
        return True
