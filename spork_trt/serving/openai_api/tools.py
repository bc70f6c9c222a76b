"""Tool calls: OpenAI's `tools` and `tool_choice` checked once, the grammar a `required` or named choice holds the
output to, and the model's text read back as `tool_calls`.

A call is JSON: one object {"name": ..., "arguments": {...}} (Llama 3.1's templates spell it "parameters"), a list
of them, or Hermes' tags around each (<tool_call>{...}</tool_call>, Qwen 2.5/3's templates). With `required` or a
named function the output is one such object, its name one of the functions and its arguments that function's
`parameters` schema (spec/grammar.py; a schema the grammar engine cannot hold exactly is a 400, as
response_format's). With `auto` the text is a call when all of it reads as one, else it is the answer's content.
Where the tools and the conversation's tool turns are written into the prompt: model.py (the checkpoint's own
template, a --chat-template file, or the generic tool format, generic_tools.py)."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from spork_trt.serving.openai_api.errors import bad_request
from spork_trt.serving.openai_api.schema import MAX_TOOLS
from spork_trt.spec.grammar import GrammarSpec

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    spec: tuple[dict, ...]  # the request's tools, as OpenAI sends them: what the template is given
    names: tuple[str, ...]
    choice: str  # "none" | "auto" | "required" | the one function's name (named)
    grammar: GrammarSpec | None  # required or named: the call the output must be

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` -> Tools (None: no tools). The functions' names, parameters and the choice are
    checked here; the grammar compiled by the caller (params.py), as response_format's."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "tool_choice needs tools: send the functions in `tools`")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"tools must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", "
                          "\"function\": {...}} objects")
    names, params = [], {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or set(t) - {"type", "function"}:
            raise bad_request(where, f'{where} must be {{"type": "function", "function": {{"name", "description", '
                              '"parameters"}}}}')
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ "
                              f"or -, got {name!r}")
        if name in params:
            raise bad_request(f"{where}.function.name", f"two tools are named {name!r}: names must be unique")
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra or not isinstance(f.get("description", ""), str) or not isinstance(f.get("parameters", {}), dict):
            raise bad_request(f"{where}.function", f"{where}.function takes name, description (a string), "
                              "parameters (a JSON schema object) and strict")
        names.append(name)
        params[name] = f.get("parameters") or {"type": "object", "properties": {}}
    picked = chosen(choice, names)
    grammar = None if picked in ("none", "auto") else GrammarSpec("json_schema", json.dumps(call_schema(
        {n: params[n] for n in (names if picked == "required" else [picked])})))
    return Tools(tuple(tools), tuple(names), picked, grammar)


def chosen(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in CHOICES:
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}')
    if name not in names:
        raise bad_request("tool_choice", f"tool_choice names {name!r}, which is not one of the tools "
                          f"({', '.join(names)})")
    return name


def call_schema(params: dict[str, dict]) -> dict:
    """One call of one of these functions: {"name": const, "arguments": its parameters}. Each function's own
    `$defs` (or `definitions`) move to the root under its name, its `$ref`s with them."""
    defs: dict = {}
    options = []
    for name, schema in params.items():
        body = rehomed(schema, f"{name}.", defs)
        options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": body},
                        "required": ["name", "arguments"], "additionalProperties": False})
    out = options[0] if len(options) == 1 else {"anyOf": options}
    return {**out, "$defs": defs} if defs else out


def rehomed(schema, prefix: str, defs: dict):
    """`schema` with its $defs taken out into `defs` (names prefixed) and its local $refs pointed there."""
    if isinstance(schema, list):
        return [rehomed(s, prefix, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("$defs", "definitions") and isinstance(v, dict):
            defs.update({prefix + n: rehomed(s, prefix, defs) for n, s in v.items()})
        elif k == "$ref" and isinstance(v, str):
            m = re.fullmatch(r"#/(?:\$defs|definitions)/(.+)", v)
            if not m:
                raise bad_request("tools", f"a tool's parameters use $ref {v!r}: only refs to its own $defs are "
                                  "supported")
            out[k] = f"#/$defs/{prefix}{m.group(1)}"
        else:
            out[k] = rehomed(v, prefix, defs)
    return out


def read_calls(text: str, tools: Tools) -> list[dict] | None:
    """OpenAI's `tool_calls` if all of `text` is calls of the request's functions, else None (the text is the
    answer's content)."""
    s = text.strip()
    if s.startswith("<tool_call>"):
        bodies = TAG.findall(s)
        if not bodies or TAG.sub("", s).strip():
            return None
    elif s[:1] in ("{", "["):
        bodies = [s]
    else:
        return None
    calls = []
    for b in bodies:
        try:
            found = json.loads(b)
        except (ValueError, RecursionError):
            return None
        for c in found if isinstance(found, list) else [found]:
            args = c.get("arguments", c.get("parameters", {})) if isinstance(c, dict) else None
            if not isinstance(args, dict) or c.get("name") not in tools.names:
                return None
            calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": c["name"], "arguments": json.dumps(args)}})
    return calls or None


class Held:
    """One streamed choice's text while it may still be a call (it begins with `{`, `[` or `<tool_call>`): held
    back, then given out as content the moment it cannot be one, or read as calls when the answer ends."""

    def __init__(self, tools: Tools | None) -> None:
        self.tools, self.text, self.logs = tools, "", ()
        self.free = tools is None or not tools.reads_calls

    def feed(self, text: str, logs: tuple) -> tuple[str, tuple]:
        """What may go out now: (text, its logprobs)."""
        if self.free:
            return text, logs
        self.text, self.logs = self.text + text, self.logs + logs
        s = self.text.lstrip()
        if s and s[0] not in "{[" and not (s.startswith("<tool_call>") or "<tool_call>".startswith(s)):
            self.free = True
            out, self.text, self.logs = (self.text, self.logs), "", ()
            return out
        return "", ()

    def end(self) -> tuple[str, tuple, list[dict] | None]:
        """At the answer's end: (text still held, its logprobs, the calls it reads as, or None)."""
        calls = None if self.free or not self.text else read_calls(self.text, self.tools)
        return self.text, self.logs, calls
