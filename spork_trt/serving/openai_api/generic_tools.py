"""The generic tool format (`serve --chat-template generic`), for checkpoints whose chat template has no tool
format: the tools and the conversation's tool turns are written as ordinary messages, which the checkpoint's own
template then renders, so every family keeps its own turn markers.

- the functions go into the system message, with the one rule of the format: to call one, answer with only a
  JSON object {"name": ..., "arguments": {...}} (read back by tools.read_calls);
- an assistant turn that called tools is that JSON (one object, or a list of them);
- the results (`role: tool`) become one user turn naming each call, so user and assistant turns still alternate
  (Gemma's and Mistral's templates refuse anything else)."""
from __future__ import annotations

import json

PREAMBLE = ("You can call functions. To call one, answer with only a JSON object of the form "
            '{{"name": <function name>, "arguments": <an object of its arguments>}} and nothing else; to call '
            "several at once, a JSON list of such objects. Otherwise answer normally. The functions:\n{functions}")


def generic_messages(messages: list[dict], tools: tuple[dict, ...]) -> list[dict[str, str]]:
    """OpenAI-shaped messages (tool_calls, role tool) and tools -> role/content messages of system, user and
    assistant only."""
    functions = "\n".join(json.dumps({k: t["function"][k] for k in ("name", "description", "parameters")
                                      if k in t["function"]}) for t in tools)
    out = [{"role": "system", "content": PREAMBLE.format(functions=functions)}]
    names: dict[str, str] = {}  # tool_call_id -> function name
    for m in messages:
        if m["role"] == "system" and len(out) == 1:
            out[0]["content"] += "\n\n" + m["content"]
        elif m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            names.update({c["id"]: c["function"]["name"] for c in m["tool_calls"]})
            out.append({"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)})
        elif m["role"] == "tool":
            name = names.get(m.get("tool_call_id", ""), "a function")
            text = f"The result of {name} (call {m.get('tool_call_id', '?')}):\n{m['content']}"
            if out[-1]["role"] == "user" and out[-1].get("results"):
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": "user", "content": text, "results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]
