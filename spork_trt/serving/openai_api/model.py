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
from spork_trt.spec.grammar import Grammars

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ServedModel:
    name: str  # the `model` clients send; anything else is a 404
    tokenizer: Tokenizer
    context: int  # positions a request may use: prompt + new tokens (the `spork` model's Service.context)
    vocab_size: int

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation (role/content dicts, checked by params.py) through the chat template, with the
        assistant's turn opened; for one user message exactly what the ensemble's preprocessing sends."""
        if not self.tokenizer.has_chat_template:
            raise bad_request("messages", f"model {self.name} has no chat template: use /v1/completions")
        try:
            return self.tokenizer.chat_ids(messages)
        except UserError as e:  # content spelling a control token under a template that rewrites content
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


def load_served_model(repo: Path, name: str | None = None) -> ServedModel:
    """The model a rendered repository serves: its `spork` config names the engines (relative to the repository),
    the slot size and the drafter; the build's manifest the window and the tokenizer."""
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
    model = ServedModel(name or default, load_tokenizer(engines, "hf", mcfg.eos_token_ids), context, mcfg.vocab_size)
    model.max_text_bytes  # noqa: B018 - the longest token's size, found once here, not in a request
    return model
