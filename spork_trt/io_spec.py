"""The ONE table of engine inputs and outputs. ONNX export (names, dynamic axes), the ONNX Runtime binding,
TensorRT optimisation profiles and Triton configs all derive from it; a test checks they agree.

Two attention layouts (`attention`), chosen at export:
- GQA (ONNX Runtime CPU, the default): every layer's attention is ONE com.microsoft GroupQueryAttention op over a
  KV buffer [batch, kv_heads, capacity, head_dim] (BNSH) bound as both past_key_i and present_key_i, so the op
  appends the new rows in place at each sequence's own context length (seqlens_k, query_seqlens) and reads only
  each sequence's own rows; the mask's columns are absolute positions [0, S), S = total_sequence_length. The
  batch's tokens are packed: input_ids, position_ids [1, N] hold every sequence's new tokens one after another
  (N = their sum), the projections, the MLP and the LM head run on those N rows, and only the op sees them padded
  to [B, T] (gathered by `padded_rows`, gathered back by `packed_rows`): a batch costs its total tokens, not B
  times its longest tree.
- PLAIN (TensorRT, and ONNX Runtime's GPU providers, whose GQA kernels are fp16/bf16 only): standard ONNX ops; the
  past is [batch, positions, kv_heads, head_dim] (for batch 1 the first P rows of a preallocated cache are one
  contiguous block, bound without a copy), new rows come out as new_key_i [batch, new, kv_heads, head_dim] and the
  mask's columns are the P past rows, then the T new ones.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from spork_trt.config import GenerateConfig, ModelConfig, SamplingConfig
from spork_trt.errors import FieldError

# symbolic dims: batch B, new tokens T, past positions P, total S = P + T, logit rows R (asked-for rows of B x T;
# GQA: of the N packed tokens), packed tokens N (GQA: every sequence's new tokens, one after another)
BATCH, NEW, PAST, TOTAL, ROWS = "batch", "new_tokens", "past_len", "total_len", "logit_rows"
PACKED = "packed_tokens"
CAPACITY = "kv_capacity"  # GQA: positions the bound KV buffer holds (>= every sequence's context + new tokens)
GQA, PLAIN = "gqa", "plain"
ATTENTIONS = (GQA, PLAIN)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]


def kv_names(n_layers: int, attention: str = PLAIN) -> list[tuple[str, str, str, str]]:
    """(past key, past value, new key, new value) names per layer; GQA's outputs are the whole updated buffers
    (present_key_i, bound to the same memory as past_key_i)."""
    out = "present" if attention == GQA else "new"
    return [(f"past_key_{i}", f"past_value_{i}", f"{out}_key_{i}", f"{out}_value_{i}") for i in range(n_layers)]


def attention_of(input_names) -> str:
    """The attention layout of a graph with these input names."""
    return GQA if "seqlens_k" in set(input_names) else PLAIN


def gqa_feeds(new: list[int], context: list[int], total: int) -> dict[str, np.ndarray]:
    """The GQA graph's batch-layout inputs besides the tokens and the mask: per sequence its new tokens n_b and
    context + n_b - 1; S = `total` (>= every context + n_b: the mask's width); where the packed tokens go in the
    op's padded [B, T] (T = the most new tokens; a padding slot repeats its sequence's first token) and back."""
    n = np.asarray(new, np.int32)  # [B]
    start = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)  # [B] first packed row of each sequence
    t = np.arange(int(n.max()))  # [T]
    real = t[None] < n[:, None]  # [B, T]
    return {"query_seqlens": n, "seqlens_k": np.asarray(context, np.int32) + n - 1,
            "total_sequence_length": np.array(total, np.int32),
            "padded_rows": np.where(real, start[:, None] + t[None], start[:, None]),  # [B, T] int64
            "packed_rows": np.nonzero(real.reshape(-1))[0].astype(np.int64)}  # [N] flat b * T + t


def kv_dims(cfg: ModelConfig, attention: str, past: bool) -> tuple[str | int, ...]:
    if attention == GQA:
        return (BATCH, cfg.n_kv_heads, CAPACITY, cfg.head_dim)
    return (BATCH, PAST if past else NEW, cfg.n_kv_heads, cfg.head_dim)


def inputs(cfg: ModelConfig, n_layers: int, attention: str = PLAIN) -> list[TensorSpec]:
    assert attention in ATTENTIONS, attention
    tokens = (1, PACKED) if attention == GQA else (BATCH, NEW)
    out = [TensorSpec("input_ids", "int64", tokens), TensorSpec("position_ids", "int64", tokens),
           TensorSpec("attention_mask", "bool", (BATCH, NEW, TOTAL)),
           # the rows whose logits the graph computes, as flat indices b * T + t into the [B, T] new tokens (GQA:
           # indices into the N packed tokens): a prefill chunk asks for its last row, a batch for its trees'
           # rows only (the LM head is about a fifth of a row's compute for the default model)
           TensorSpec("logit_rows", "int64", (ROWS,))]
    if attention == GQA:  # per sequence: new tokens n_b (rows past it are padding), context + n_b - 1; S; the
        # packed rows at the op's [B, T] slots, and the [B, T] slot of every packed row (gqa_feeds)
        out += [TensorSpec("query_seqlens", "int32", (BATCH,)), TensorSpec("seqlens_k", "int32", (BATCH,)),
                TensorSpec("total_sequence_length", "int32", ()), TensorSpec("padded_rows", "int64", (BATCH, NEW)),
                TensorSpec("packed_rows", "int64", (PACKED,))]
    for pk, pv, _, _ in kv_names(n_layers, attention):
        out += [TensorSpec(pk, "float32", kv_dims(cfg, attention, True)),
                TensorSpec(pv, "float32", kv_dims(cfg, attention, True))]
    return out


def outputs(cfg: ModelConfig, n_layers: int, taps: tuple[int, ...] = (), attention: str = PLAIN) -> list[TensorSpec]:
    """`taps`: the graph also outputs the hidden states after these layers at every new token (the learned draft
    head's features; a target built with a head has them)."""
    kv = kv_dims(cfg, attention, False)
    out = [TensorSpec("logits", "float32", (ROWS, cfg.vocab_size))]
    for _, _, nk, nv in kv_names(n_layers, attention):
        out += [TensorSpec(nk, "float32", kv), TensorSpec(nv, "float32", kv)]
    if taps:
        out.append(TensorSpec(HIDDEN, "float32", ((1, PACKED) if attention == GQA else (BATCH, NEW))
                              + (len(taps) * cfg.dim,)))
    return out


HIDDEN = "hidden"  # [B, T, k*C] (GQA: [1, N, k*C]): the hidden states after each of the k tapped layers


def head_inputs(cfg: ModelConfig) -> list[TensorSpec]:
    """The learned draft head's graph (one decoder layer, PLAIN layout; draft_head.py): the next tokens' target
    embeddings, the features (fused target hidden states or the head's own outputs), positions, mask, past rows."""
    c, kv = cfg.dim, (1, PAST, cfg.n_kv_heads, cfg.head_dim)
    return [TensorSpec("emb", "float32", (1, NEW, c)), TensorSpec("g", "float32", (1, NEW, c)),
            TensorSpec("position_ids", "int64", (1, NEW)), TensorSpec("attention_mask", "bool", (1, NEW, TOTAL)),
            TensorSpec("past_key_0", "float32", kv), TensorSpec("past_value_0", "float32", kv)]


def head_outputs(cfg: ModelConfig, vocab: int) -> list[TensorSpec]:
    """h [1, T, C] (the rows' outputs: deeper draft rows read them), draft-vocabulary logits [1, T, N], new rows."""
    kv = (1, NEW, cfg.n_kv_heads, cfg.head_dim)
    return [TensorSpec("h", "float32", (1, NEW, cfg.dim)), TensorSpec("logits", "float32", (1, NEW, vocab)),
            TensorSpec("new_key_0", "float32", kv), TensorSpec("new_value_0", "float32", kv)]


def dynamic_axes(specs: list[TensorSpec]) -> dict[str, dict[int, str]]:
    return {s.name: {i: d for i, d in enumerate(s.dims) if isinstance(d, str)} for s in specs}


# ---- Triton tensors: the ensemble's request/response (TensorRT-LLM backend names where the meaning is the same)
# and the tensors passed between its steps. Dims exclude the batch dim (every model has max_batch_size > 0).

@dataclass(frozen=True)
class TritonTensor:
    name: str
    dtype: str  # Triton data type without the TYPE_ prefix: STRING, INT32, FP32, UINT64, BOOL
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def kind(self) -> type:
        """What one of its values converts to."""
        return {"STRING": str, "INT32": int, "UINT64": int, "FP32": float, "BOOL": bool}[self.dtype]


# optional only so that preprocessing answers a request without it with a 400 naming it (Triton's own refusal of a
# missing required input reaches the HTTP generate endpoint as a 200 with an unrelated error)
TEXT_INPUT = TritonTensor("text_input", "STRING", (1,), optional=True)
TEXT_MISSING = 'text_input is missing: send the prompt as "text_input" (a string)'  # the answer to a request without it
MAX_TOKENS = TritonTensor("max_tokens", "INT32", (1,), optional=True)
TEMPERATURE = TritonTensor("temperature", "FP32", (1,), optional=True)  # 0 (the default) means greedy
TOP_P = TritonTensor("top_p", "FP32", (1,), optional=True)
TOP_K = TritonTensor("top_k", "INT32", (1,), optional=True)
SEED = TritonTensor("seed", "UINT64", (1,), optional=True)
STOP_WORDS = TritonTensor("stop_words", "STRING", (-1,), optional=True)  # [1, n]: the text ends where one starts


@dataclass(frozen=True)
class CompatInput:
    """An input that clients written for TensorRT-LLM's ensemble send (Triton's OpenAI-compatible frontend sends these
    to any model but a vLLM one): another name for one of REQUEST_FIELDS (`alias`), or a setting accepted only at the
    value this server always works at (`only`; any other is refused naming it), or else a flag that changes nothing
    here (accepted and ignored)."""

    tensor: TritonTensor
    alias: str | None = None  # the REQUEST_FIELDS field it also names
    only: object = None  # the one value accepted


COMPAT_INPUTS = (
    CompatInput(TritonTensor("random_seed", "UINT64", (1,), optional=True), alias="seed"),  # frontends before 25.06
    # the target's own distribution, unpenalized (lossless speculation samples from exactly it)
    CompatInput(TritonTensor("frequency_penalty", "FP32", (1,), optional=True), only=0.0),
    CompatInput(TritonTensor("presence_penalty", "FP32", (1,), optional=True), only=0.0),
    CompatInput(TritonTensor("exclude_input_in_output", "BOOL", (1,), optional=True), only=True),  # no echo
    # num_input_tokens and num_output_tokens are in every response whatever these say
    CompatInput(TritonTensor("return_num_input_tokens", "BOOL", (1,), optional=True)),
    CompatInput(TritonTensor("return_num_output_tokens", "BOOL", (1,), optional=True)),
)
MAX_GRAMMAR_BYTES = 256 * 1024  # a request's grammar tensor (spec/grammar.py: a JSON schema, regex or EBNF)
MAX_CACHE_SCOPE = 128  # characters of a cache_scope (the OpenAI API sends a 64-character digest)
SERVED_MODES = ("spork", "plain")  # spec_mode values (the first the default); the lossy gate mode is never served
REQUEST_PARAMS = (  # ensemble inputs that go straight to the spork step; absent means the default
    MAX_TOKENS, TEMPERATURE, TOP_P, TOP_K, SEED, STOP_WORDS,
    TritonTensor("stream", "BOOL", (1,), optional=True),
    TritonTensor("spec_mode", "STRING", (1,), optional=True),  # SERVED_MODES
    TritonTensor("timeout_s", "FP32", (1,), optional=True),  # the request's deadline, at most the server's
    TritonTensor("cache_scope", "STRING", (1,), optional=True),  # prefix reuse only within it (prefix_cache.py)
    TritonTensor("grammar", "STRING", (1,), optional=True),  # {"kind", "source"}: what the output must match
    *(c.tensor for c in COMPAT_INPUTS),
)


@dataclass(frozen=True)
class RequestField:
    """One request setting as every front end spells it (DESIGN 8.17): its config field (GenerateConfig's or its
    SamplingConfig's; the limits and the default live there), its Triton tensor, its `generate` flag."""

    field: str
    tensor: TritonTensor | None  # None: not served
    flag: str  # `python -m spork_trt generate`'s
    kind: type  # what a value converts to
    help: str
    many: bool = False  # a list of values: a repeatable flag, a [1, n] tensor

    @property
    def client_flag(self) -> str:
        """`client` and `demo` flags are named after the tensors they send."""
        return "--" + self.tensor.name.replace("_", "-")

    @property
    def default(self):
        return getattr(GenerateConfig if self.field in GENERATE_FIELDS else SamplingConfig, self.field)


GENERATE_FIELDS = ("max_new_tokens", "stop_strings")
REQUEST_FIELDS = (
    RequestField("max_new_tokens", MAX_TOKENS, "--max-new-tokens", int, "most new tokens"),
    RequestField("temperature", TEMPERATURE, "--temperature", float, "0 means greedy, else at least 0.01"),
    RequestField("top_p", TOP_P, "--top-p", float, "nucleus mass in (0, 1]"),
    RequestField("top_k", TOP_K, "--top-k", int, "0 disables top-k"),
    RequestField("seed", SEED, "--seed", int, "sampling seed in [0, 2**64 - 1) (default: random)"),
    RequestField("stop_strings", STOP_WORDS, "--stop", str, "stop string (repeatable)", many=True),
)
FIELDS = {f.field: f for f in REQUEST_FIELDS}
assert all(c.alias in FIELDS for c in COMPAT_INPUTS if c.alias)


def request_config(values: Mapping[str, object], name: Callable[[RequestField], str]) -> GenerateConfig:
    """The one way a front end builds a request's config: `values` by config field (absent or None: the default);
    a bad one raises the config's error with the field spelled as this front end spells it (`name`)."""
    given = {k: v for k, v in values.items() if v is not None}
    assert set(given) <= set(FIELDS), set(given) - set(FIELDS)
    for key, value in given.items():
        fits_tensor(FIELDS[key], value, name)
    try:
        sampling = SamplingConfig(**{k: v for k, v in given.items() if k not in GENERATE_FIELDS})
        return GenerateConfig(**{k: v for k, v in given.items() if k in GENERATE_FIELDS}, sampling=sampling)
    except FieldError as e:
        raise e.named(name(FIELDS[e.field])) from None


INT_RANGES = {"INT32": (-2**31, 2**31), "UINT64": (0, 2**64)}  # [low, high) of a tensor's integers
FP32_MAX = 3.4028234663852886e38


def fits_tensor(f: RequestField, value, name: Callable[[RequestField], str]) -> None:
    """A value a front end took from JSON or flags must fit its Triton tensor: an integer its INT32 or UINT64, a
    finite float FP32's range, text UTF-8 (no lone surrogate). Else a FieldError naming the field as `name` spells
    it, never a value silently cast."""
    if f.tensor is None:
        return
    spelled = name(f)
    kind = f.tensor.dtype
    if kind in INT_RANGES and isinstance(value, int) and not isinstance(value, bool):
        low, high = INT_RANGES[kind]
        if not low <= value < high:
            raise FieldError(f.field, f"must be in [{low}, {high}) (a {kind} tensor), got {value}", spelled)
    elif kind == "FP32" and isinstance(value, float) and math.isfinite(value) and abs(value) > FP32_MAX:
        raise FieldError(f.field, f"must be at most {FP32_MAX:g} in magnitude (an FP32 tensor), got {value:g}",
                         spelled)
    for text in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(text, str) and not is_utf8(text):
            raise FieldError(f.field, "must be UTF-8 text: it holds a lone UTF-16 surrogate", spelled)


def is_utf8(text: str) -> bool:
    """Whether `text` can be UTF-8: JSON can carry a lone UTF-16 surrogate ("\\ud800"), no tokenizer or tensor can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


STATS_OUTPUTS = (  # from the spork step straight to the client, in every response
    TritonTensor("acceptance_rate", "FP32", (1,)),
    TritonTensor("total_accepted_draft_tokens", "INT32", (1,)),
    TritonTensor("total_draft_tokens", "INT32", (1,)),
    TritonTensor("mean_accepted_length", "FP32", (1,)),
    TritonTensor("num_steps", "INT32", (1,)),
    TritonTensor("cached_tokens", "INT32", (1,)),  # prompt tokens whose KV rows were reused (prefix_cache)
    # "" until the final response: eos | max_tokens | stop_string | timeout (the deadline passed: what was generated)
    TritonTensor("stop_reason", "STRING", (1,)),
    # TensorRT-LLM's counts (Triton's OpenAI frontend reads them for `usage`): the prompt's tokens (after the chat
    # template), and the generated tokens this response carries (a stream's responses add up to the whole answer)
    TritonTensor("num_input_tokens", "INT32", (1,)),
    TritonTensor("num_output_tokens", "INT32", (1,)),
)
TEXT_OUTPUT = TritonTensor("text_output", "STRING", (1,))
PROMPT_IDS = TritonTensor("input_ids", "INT32", (-1,))  # preprocessing -> spork
# spork's input_ids: optional only so that a cancel (cancel_key alone) reaches the model; a request without them is
# answered 400 `input_ids is missing`
SPORK_IDS = TritonTensor("input_ids", "INT32", (-1,), optional=True)
# the unary models (spork_unary, ensemble_unary) -> spork: a random key naming the request (they make one per request
# and never return it, so no client can name another's request); sent alone (no input_ids) it cancels the request
# carrying it (cancel_board.py, triton_unary.py)
CANCEL_KEY = TritonTensor("cancel_key", "STRING", (1,), optional=True)
CANCEL_KEY_HEX = 32  # its length in lowercase hex digits: 128 random bits
# spork -> postprocessing: the response's new tokens after a few already sent (service.DETOKENIZE_CONTEXT), so the
# text they add is decoded from a short window, not the whole prefix
OUTPUT_IDS = TritonTensor("output_ids", "INT32", (-1,))
SENT_LEN = TritonTensor("sent_len", "INT32", (1,))  # how many of output_ids earlier responses carried
FINAL = TritonTensor("final", "BOOL", (1,))  # last response of the request: flush held-back characters
# the final response's stop strings (none before it): postprocessing ends its text where the first one starts
CUT_AT = TritonTensor("cut_at", "STRING", (-1,))
# the `spork` model's stream alone (the OpenAI API's; not the ensembles' nor the unary models'): each new token's
# log-probability under the target and its k likeliest (spec/logprobs.py), k = `logprobs` (absent: none, all empty)
LOGPROBS = TritonTensor("logprobs", "INT32", (1,), optional=True)
LOGPROB_OUTPUTS = (
    TritonTensor("output_logprobs", "FP32", (-1,)),  # [1, m]: one per token of output_ids[sent_len:]
    TritonTensor("top_logprob_ids", "INT32", (-1, -1)),  # [1, m, k]
    TritonTensor("top_logprobs", "FP32", (-1, -1)),  # [1, m, k], likeliest first
)


@dataclass(frozen=True)
class TritonStep:
    name: str  # model name in the repository
    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    decoupled: bool = False


TRITON_STEPS = (
    TritonStep("preprocessing", (TEXT_INPUT,), (PROMPT_IDS,)),
    TritonStep("spork", (SPORK_IDS, *REQUEST_PARAMS, CANCEL_KEY, LOGPROBS),
               (OUTPUT_IDS, SENT_LEN, FINAL, CUT_AT, *STATS_OUTPUTS, *LOGPROB_OUTPUTS), decoupled=True),
    TritonStep("postprocessing", (OUTPUT_IDS, SENT_LEN, FINAL, CUT_AT), (TEXT_OUTPUT,)),
)
ENSEMBLE_INPUTS = (TEXT_INPUT, *REQUEST_PARAMS)
ENSEMBLE_OUTPUTS = (TEXT_OUTPUT, *STATS_OUTPUTS)
# Triton refuses HTTP infer and gRPC ModelInfer for an ensemble with a decoupled step, so the repository has two
# entry points with these tensors: `ensemble` (an ensemble of the steps; decoupled: streaming, generate,
# generate_stream) and `ensemble_unary` (a python model making the same steps' calls itself, through BLS: exactly one
# response, for ModelInfer over HTTP and gRPC, and cancellable, which an ensemble is not in Triton 2.51: it checks an
# ensemble's cancellation only between steps). `spork_unary` is the spork step answered once (token ids in).
ENSEMBLE = "ensemble"
UNARY_MODELS = ("spork_unary", "ensemble_unary")  # call `spork` once per request with a cancel key (triton_unary.py)
PYTHON_MODELS = (*(s.name for s in TRITON_STEPS), *UNARY_MODELS)  # each a triton_repo/<name>/model.py adapter


ENSEMBLE_STEP = TritonStep(ENSEMBLE, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS)  # what clients send to either entry point
NUMPY = {"STRING": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}


def request_arrays(step: TritonStep, values: Mapping[str, object]) -> dict[str, tuple[np.ndarray, str]]:
    """What a client sends to `step`: input name -> (its array with the batch dim, tritonclient's dtype name), each
    typed and shaped by the step's own table; `values`: name -> a value (a sequence for a [1, n] tensor; text as
    str), None: not sent."""
    specs = {t.name: t for t in step.inputs}
    out = {}
    for name, value in values.items():
        if value is None:
            continue
        t = specs[name]
        items = list(value) if t.dims == (-1,) else [value]  # [1, n] or [1, 1]
        if t.dtype == "STRING":
            items = [v.encode("utf-8") for v in items]
        out[name] = (np.array([items], NUMPY[t.dtype]), "BYTES" if t.dtype == "STRING" else t.dtype)
    return out


def model_step(model: str) -> TritonStep:
    """The tensors a python model of the repository takes and gives: its step's. spork_unary's are the spork step's,
    answered once, without cancel_key (it makes its own key per request: a client cannot send one), with input_ids
    required (a cancel is spork's alone) and without logprobs (the stream's alone); ensemble_unary's are the
    ensemble's, answered once."""
    steps = {s.name: s for s in TRITON_STEPS}
    if model == "ensemble_unary":
        return TritonStep(model, ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS)
    if model != "spork_unary":
        return steps[model]
    spork = steps["spork"]
    inputs = tuple(PROMPT_IDS if t == SPORK_IDS else t for t in spork.inputs if t not in (CANCEL_KEY, LOGPROBS))
    outputs = tuple(t for t in spork.outputs if t not in LOGPROB_OUTPUTS)
    return replace(spork, name=model, inputs=inputs, outputs=outputs, decoupled=False)


def error_kind(message: str) -> str:
    """What an error answer of a step was, from its message alone: a BLS call (the unary models' calls of
    `preprocessing`, `spork`, `postprocessing`) receives every error as INTERNAL (Triton 2.51), and the caller answers
    with this kind's code. "unavailable": a refusal to retry (errors.RETRY_HINTS); "invalid": a bad field (a bad
    input's message starts with the name of one of the steps' inputs, e.g. `text_input is empty`); else
    "internal"."""
    from spork_trt.errors import retryable

    if retryable(message):
        return "unavailable"
    return "invalid" if message.split(" ", 1)[0] in {t.name for s in TRITON_STEPS for t in s.inputs} else "internal"
