"""The served model as the front end sees it: its name, the build's tokenizer and chat template, the context a
request may use (read from the rendered repository, as the `spork` model computes it), prompts -> token ids."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from spork_trt.config import SpecConfig
from spork_trt.checkpoint.tokenizer import Tokenizer, load_tokenizer
from spork_trt.errors import UserError
from spork_trt.serving.openai_api.errors import bad_request
from spork_trt.serving.openai_api.generic_tools import generic_messages
from spork_trt.serving.openai_api.tools import Tools
from spork_trt.spec.grammar import Grammars

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ServedModel:
    name: str  # the `model` clients send; anything else is a 404
    tokenizer: Tokenizer
    context: int  # positions a request may use: prompt + new tokens (the `spork` model's Service.context)
    vocab_size: int
    tool_format: str = ""  # how tools reach the prompt: "template" | "generic" | "" (they cannot: tools are a 400)

    def chat_ids(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """The conversation (checked by messages.py) and the request's tools through the chat template, with the
        assistant's turn opened; for one user message exactly what the ensemble's preprocessing sends."""
        if not self.tokenizer.has_chat_template:
            raise bad_request("messages", f"model {self.name} has no chat template: use /v1/completions")
        spec = None if tools is None else list(tools.spec)
        if self.tool_format == "generic" and (spec or any(m["role"] == "tool" or "tool_calls" in m
                                                          for m in messages)):
            messages, spec = generic_messages(messages, tools.spec if tools else ()), None
        try:
            return self.tokenizer.chat_ids(messages, spec)
        except UserError as e:  # a control token's text where it cannot be quoted; a template's refusal
            raise bad_request("messages", str(e)) from None

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The grammar compiler for this tokenizer: response_format's grammar is compiled here first (a bad one is
        a 400 before any work), then by the spork model, which applies it."""
        return Grammars(self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_ids)

    @property
    def max_text_bytes(self) -> int:
        """Bytes of text past which no prompt fits the context (Tokenizer.max_text_bytes; computed once)."""
        return self.tokenizer.max_text_bytes(self.context)

    def prompt_ids(self, prompt: str) -> list[int]:
        """A completion prompt as written (no template), as `generate --raw` encodes it."""
        return list(self.tokenizer.hf.encode(prompt, add_special_tokens=True))


def tool_format(tok: Tokenizer, chat_template: str | None) -> str:
    """`chat_template`: --chat-template's value (None: the checkpoint's own template; "generic": the generic
    tool format over it; else a Jinja file that replaces it). A template that reads `tools` writes them itself."""
    if chat_template == "generic":
        return "generic"
    if chat_template is not None:
        path = Path(chat_template)
        if not path.is_file():
            raise UserError(f"--chat-template {chat_template}: no such file (give a Jinja chat template file, or "
                            "generic)")
        tok.hf.chat_template = path.read_text(encoding="utf-8", errors="strict")
        tok.render([{"role": "user", "content": "Hello"}])  # a broken template fails `serve`, not a request
    return "template" if "tools" in (getattr(tok.hf, "chat_template", None) or "") else ""


def load_served_model(repo: Path, name: str | None = None, chat_template: str | None = None) -> ServedModel:
    """The model a rendered repository serves: its `spork` config names the engines (relative to the repository),
    the slot size and the drafter; the build's manifest the window and the tokenizer; `chat_template`: tool_format's
    argument."""
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.serving.triton_repo import spork_model

    spork = spork_model(repo)
    params, engines = spork.params, spork.engines
    manifest = mf.read(engines)
    mcfg = mf.spec_config(manifest["model"])
    # Service.context: the window, or less when the slots are smaller (a slot keeps room for one step's tree)
    context = min(mcfg.max_seq_len, int(params["max_len"]) - SpecConfig.for_draft(params["draft"]).tree_room)
    source = Path(manifest["source"]["path"])
    default = source.name.removesuffix(".gguf") if source.suffix == ".gguf" else source.name
    tok = load_tokenizer(engines, "hf", mcfg.eos_token_ids)
    model = ServedModel(name or default, tok, context, mcfg.vocab_size, tool_format(tok, chat_template))
    model.max_text_bytes  # noqa: B018 - the longest token's size, found once here, not in a request
    return model
