"""`python -m spork_trt chat`: an interactive terminal chat over a running server's OpenAI-compatible API (the
`openai` client, streaming). Each turn sends the whole conversation, as every chat client does; the server's prefix
reuse prefills only what is new since the last turn (`usage.prompt_tokens_details.cached_tokens`, shown per turn)."""
from __future__ import annotations

import argparse
import sys

from spork_trt.errors import UserError

CHAT_EXAMPLES = """examples:
  python -m spork_trt serve &                         # the OpenAI API on 127.0.0.1:9000
  python -m spork_trt chat                            # type a message, Enter; /reset starts over, /exit or Ctrl-D ends
  python -m spork_trt chat --system "Answer in one sentence." --max-tokens 256
  echo "What is 2+2?" | python -m spork_trt chat      # one turn from a pipe
"""


def add_chat_command(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat over a running server's OpenAI API", epilog=CHAT_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Chat with the served model; answers stream to stdout, each turn's usage to stderr.")
    c.add_argument("--url", default="http://127.0.0.1:9000/v1", help="the OpenAI API's base URL (default: %(default)s)")
    c.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    c.add_argument("--system", default=None, help="a system message opening the conversation")
    c.add_argument("--max-tokens", type=int, default=None, help="most new tokens a turn (default: all that fit)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)")


def cmd_chat(a: argparse.Namespace) -> int:
    import openai

    client = openai.OpenAI(base_url=a.url, api_key="none", max_retries=0)
    try:
        model = a.model or client.models.list().data[0].id
    except openai.APIConnectionError:
        raise UserError(f"no OpenAI API answers at {a.url}: start one with `python -m spork_trt serve`") from None
    opening = [{"role": "system", "content": a.system}] if a.system else []
    messages = list(opening)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(opening)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            answer = turn(client, model, messages, a)
        except openai.APIStatusError as e:
            messages.pop()
            print(f"error: {e.message}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer})


def turn(client, model: str, messages: list[dict], a: argparse.Namespace) -> str:
    """Stream one answer to stdout; its usage to stderr; returns the answer's text."""
    text, usage = [], None
    for c in client.chat.completions.create(model=model, messages=messages, max_tokens=a.max_tokens,
                                            temperature=a.temperature, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            text.append(c.choices[0].delta.content)
            print(text[-1], end="", flush=True)
        usage = c.usage or usage
    print(flush=True)
    if usage is not None:
        print(f"[{usage.completion_tokens} tokens; prompt {usage.prompt_tokens}, of which "
              f"{usage.prompt_tokens_details.cached_tokens} reused from the last turn]", file=sys.stderr, flush=True)
    return "".join(text)
