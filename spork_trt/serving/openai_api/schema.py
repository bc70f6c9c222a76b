"""The requests the API takes, as pydantic models: the contract `/openapi.json` publishes (what a client, a code
generator or a fuzzer reads) and the first check of every body, on the parsing thread (app.parse): each top-level
field's JSON type, required fields, and no field this server does not know. A failure is a 400 in OpenAI's shape
naming the field (`invalid`). The values' meaning (ranges, lengths, the context, the messages' and tools' inner
rules with their exact `param`) is checked after, in one place each: params.py, messages.py, tools.py and the
request configs (io_spec.request_config: the wire types' int32/uint64/float32 ranges).

Nested fields (messages, tools, tool_choice, response_format, stop, prompt) are typed `Any` here and documented by
their JSON schema (`Doc`): their rules name exact params (`messages[2].role`) the hand-written checks give."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import WithJsonSchema

from spork_trt.serving.openai_api.errors import ApiError, bad_request
from spork_trt.spec.logprobs import MAX_TOP

MAX_N = 16  # choices per request (each sampled one is a request of its own)
MAX_TOP_CHAT, MAX_TOP_COMPLETION = MAX_TOP, 5  # OpenAI's bounds: top_logprobs (chat), logprobs (completions)
MAX_SALT = 256  # characters of a cache_salt
MAX_MESSAGES = 4096  # messages in one chat request
MAX_PARTS = 256  # text parts in one message's content
MAX_TOOLS = 128  # functions in one request (OpenAI's limit)


def Doc(schema: dict) -> WithJsonSchema:  # noqa: N802 - reads as a type annotation
    return WithJsonSchema(schema)


TEXT = {"type": "string", "minLength": 1}
PARTS = {"type": "array", "maxItems": MAX_PARTS, "items": {
    "type": "object", "required": ["type", "text"], "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, PARTS, {"type": "null"}]},
    "name": {"type": "string"}, "tool_call_id": {"type": "string", "minLength": 1, "maxLength": 128},
    "tool_calls": {"type": "array", "items": CALL}, "refusal": {"type": ["string", "null"]}}}
TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
            "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    {"type": "object", "required": ["type", "regex"], "properties": {"type": {"const": "regex"}, "regex": TEXT}},
    {"type": "object", "required": ["type", "ebnf"], "properties": {"type": {"const": "ebnf"}, "ebnf": TEXT}}]}
STOP = {"anyOf": [TEXT, {"type": "array", "minItems": 1, "maxItems": 4, "items": TEXT}, {"type": "null"}]}


def default_only(*allowed) -> Any:
    """A field accepted only at OpenAI's default (params.DEFAULT_ONLY checks it, naming what is allowed)."""
    return Annotated[Any, Doc({"enum": [*allowed, None]})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None


Number = StrictFloat | StrictInt


class Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid")
    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = None  # the ranges: GenerateConfig's, SamplingConfig's and the wire's
    stop: Annotated[Any, Doc(STOP)] = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    spec_mode: Annotated[StrictStr, Doc({"enum": ["spork", "plain"]})] | None = None  # extension: the baseline
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=MAX_SALT)] | None = None
    response_format: Annotated[Any, Doc(RESPONSE_FORMAT)] = None
    # no effect on the answer
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    # accepted only at OpenAI's defaults (params.DEFAULT_ONLY)
    best_of: default_only(1) = None
    echo: default_only(False) = None
    suffix: default_only("") = None
    frequency_penalty: default_only(0) = None
    presence_penalty: default_only(0) = None
    logit_bias: default_only({}) = None
    functions: default_only([]) = None
    function_call: default_only("none") = None
    parallel_tool_calls: default_only(True, False) = None
    modalities: default_only(["text"]) = None
    store: default_only(False) = None


class ChatRequest(Common):
    """POST /v1/chat/completions."""

    messages: Annotated[Any, Doc({"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": MESSAGE})]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_CHAT)] | None = None
    tools: Annotated[Any, Doc({"type": "array", "maxItems": MAX_TOOLS, "items": TOOL})] = None
    tool_choice: Annotated[Any, Doc(TOOL_CHOICE)] = None


class CompletionRequest(Common):
    """POST /v1/completions (one prompt per request)."""

    prompt: Annotated[Any, Doc({"anyOf": [TEXT, {"type": "array", "minItems": 1, "maxItems": 1, "items": TEXT}]})]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_COMPLETION)] | None = None


def param_of(loc: tuple) -> str:
    """A pydantic error location -> the field as OpenAI names it: ("messages", 0, "role") -> messages[0].role;
    the member of a union pydantic names (`int`, `constrained-int`) is no field."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and (part in ("int", "float", "str", "bool", "none") or part.startswith(("constrained-", "function-"))):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def invalid(e: ValidationError) -> ApiError:
    """The first error of a body that does not fit its model, as a 400 naming the field."""
    err = e.errors(include_url=False, include_input=False)[0]
    param = param_of(err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return bad_request(param, f"unrecognized request argument: {param}", "unrecognized_argument")
    if err["type"] == "missing":
        return bad_request(param, f"{param} is required")
    return bad_request(param, f"{param}: {err['msg']}")


CHAT, COMPLETION = "chat.completion", "text_completion"  # a request's kind: its response's `object`
MODELS: dict[str, type[Common]] = {CHAT: ChatRequest, COMPLETION: CompletionRequest}


def checked(body: dict, kind: str) -> None:
    """Raise the 400 of the first field of `body` that does not fit `kind`'s model."""
    try:
        MODELS[kind].model_validate(body, strict=True)
    except ValidationError as e:
        raise invalid(e) from None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    """Every refusal (errors.ApiError.body)."""

    error: ErrorBody


REF = "#/components/schemas/{model}"
ERRORS = {400: "a malformed request (`param` names the field)", 401: "no or a wrong API key",
          404: "an unknown model or route", 413: "a body past --max-body-bytes", 415: "a body not declared JSON",
          503: "busy or the model server is unavailable (Retry-After)"}


def components() -> dict[str, dict]:
    """The schemas `/openapi.json` holds under components: the request models, the error, what they refer to."""
    out = {}
    for m in (*MODELS.values(), Error):
        schema = m.model_json_schema(ref_template=REF)
        out.update(schema.pop("$defs", {}))
        out[m.__name__] = schema
    return out


def operation(kind: str) -> dict:
    """The OpenAPI fields of a POST route taking `kind`'s body (its route reads the body itself: app.read_body)."""
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model=MODELS[kind].__name__)}}}},
            "responses": {"200": {"description": "the answer (text/event-stream chunks with stream: true)"},
                          **{str(k): {"description": v, **error} for k, v in ERRORS.items()}}}
