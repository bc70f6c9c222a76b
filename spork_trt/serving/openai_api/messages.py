"""A chat request's `messages` -> the dicts the chat template renders: text content (a string or text parts), the
roles a template knows, and, where the request may use tools, the assistant's `tool_calls` (arguments as objects,
as templates read them) and `tool` results with their `tool_call_id`."""
from __future__ import annotations

import json

from spork_trt.io_spec import is_utf8
from spork_trt.serving.openai_api.errors import bad_request
from spork_trt.serving.openai_api.model import ROLES
from spork_trt.serving.openai_api.schema import MAX_MESSAGES, MAX_PARTS

MAX_CALLS = 128  # tool calls in one assistant message


def messages(value, tools_ok: bool) -> list[dict]:
    """`tools_ok`: the model has a tool format (model.py); without one a tool turn is refused, naming that."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    if len(value) > MAX_MESSAGES:
        raise bad_request("messages", f"messages holds {len(value)} messages: at most {MAX_MESSAGES} per request")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES and role != "tool":
            raise bad_request(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)} or tool")
        tool_turn = role == "tool" or bool(m.get("tool_calls"))
        if tool_turn and not tools_ok:
            raise bad_request(f"{where}.role", f"{where} is a tool turn, but this model's chat template has no tool "
                              "format: the server needs --chat-template (generic, or a template file of yours)")
        allowed = {"role", "content", "name"} | ({"tool_call_id"} if role == "tool" else set()) | (
            {"tool_calls", "refusal"} if role == "assistant" else set())
        extra = set(m) - allowed
        if extra:
            raise bad_request(f"{where}.{sorted(extra)[0]}", f"{where}.{sorted(extra)[0]} is not supported")
        if role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": "" if m.get("content") is None else
                        content(m["content"], f"{where}.content"), "tool_calls": calls(m["tool_calls"], where)})
            continue
        msg = {"role": ROLES.get(role, role), "content": content(m.get("content"), f"{where}.content")}
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= 128:
                raise bad_request(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of the call this "
                                  "result answers")
            msg["tool_call_id"] = utf8(call_id, f"{where}.tool_call_id")
        out.append(msg)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise bad_request("messages", "messages hold no text: send some")
    return out


def calls(value, where: str) -> list[dict]:
    """An assistant message's tool_calls, their arguments (a JSON object in a string, as OpenAI sends them)
    parsed."""
    if not isinstance(value, list) or len(value) > MAX_CALLS:
        raise bad_request(f"{where}.tool_calls", f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls")
    out = []
    for j, c in enumerate(value):
        here = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(c.get("id"), str) and isinstance(f.get("name"), str)
                and isinstance(f.get("arguments"), str)):
            raise bad_request(here, f'{here} must be {{"id", "type": "function", "function": {{"name", "arguments": '
                              'a JSON object as a string}}}}')
        try:
            args = json.loads(utf8(f["arguments"], f"{here}.function.arguments"))
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise bad_request(f"{here}.function.arguments", f"{here}.function.arguments must be a JSON object")
        out.append({"id": utf8(c["id"], f"{here}.id"), "type": "function",
                    "function": {"name": utf8(f["name"], f"{here}.function.name"), "arguments": args}})
    return out


def content(value, where: str) -> str:
    if isinstance(value, str):
        return utf8(value, where)
    if isinstance(value, list) and len(value) > MAX_PARTS:
        raise bad_request(where, f"{where} holds {len(value)} parts: at most {MAX_PARTS} per message")
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"),
                                                                                                   str) for p in value):
        return utf8("".join(p["text"] for p in value), where)
    raise bad_request(where, f"{where} must be a string or a list of text parts (this model reads text only)")


def utf8(text: str, where: str) -> str:
    """`text`, refused when it cannot be UTF-8 (io_spec.is_utf8)."""
    if not is_utf8(text):
        raise bad_request(where, f"{where} must be UTF-8 text: it holds a lone UTF-16 surrogate")
    return text


def text_bytes(messages: list[dict]) -> int:
    """Bytes of text the template will render from these messages: contents and tool-call arguments."""
    return sum(len(m["content"].encode()) + (len(json.dumps(m["tool_calls"])) if m.get("tool_calls") else 0)
               for m in messages)
