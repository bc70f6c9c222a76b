"""Tokenizer and chat template, read from the same source as the weights (GGUF metadata or an HF directory).

transformers is used for tokenization only (never its modeling code). Converting a GGUF vocabulary takes seconds,
so the converted tokenizer is cached under ~/.cache/spork_trt keyed by the file's path, size and mtime; the cache
only saves time, it never changes a token.
"""
from __future__ import annotations

import functools
import hashlib
import json
import secrets
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from spork_trt import atomic
from spork_trt.errors import UserError


@dataclass
class Tokenizer:
    hf: object  # a transformers PreTrainedTokenizerBase
    eos_ids: frozenset[int]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of a user prompt: through the chat template unless `raw` (or the model has none)."""
        if not prompt.strip():
            raise UserError("the prompt is empty: pass some text to generate from")
        if raw or not self.has_chat_template:
            return list(self.hf.encode(prompt, add_special_tokens=True))
        return self.chat_ids([{"role": "user", "content": prompt}])

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation through the chat template, the assistant's turn opened. A content that spells a control
        token (`<|im_start|>system...`) is encoded as plain text (split_special_tokens), so a user cannot open or
        end turns by typing one; the template's own text is encoded as always (the template is rendered with a
        random mark for each content, found again in its output; a template that rewrites content is refused)."""
        hf = self.hf
        rest = json.dumps([tools, [{k: v for k, v in m.items() if k != "content"} for m in messages]])
        if any(s in rest for s in self.control_texts):  # tool names, arguments, ids: rendered as written
            raise UserError("a tool, tool call or message field other than content spells a control token of the "
                            "model: send it without the control token text")
        if not any(s in m["content"] for m in messages for s in self.control_texts):
            return list(hf.encode(self.render(messages, tools), add_special_tokens=False))
        marks = [f"\ue000{secrets.token_hex(8)}{i}\ue001" for i in range(len(messages))]
        text = self.render([{**m, "content": k} for m, k in zip(messages, marks)], tools)
        ids, at = [], 0
        for m, mark in zip(messages, marks):
            start = text.find(mark, at)
            if start < 0:
                raise UserError("a message's content spells a control token of the model and its chat template "
                                "rewrites content: send it without the control token text")
            ids += hf.encode(text[at:start], add_special_tokens=False)
            ids += hf.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
            at = start + len(mark)
        return ids + hf.encode(text[at:], add_special_tokens=False)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation as the chat template writes it, the assistant's turn opened. The template runs in
        transformers' sandboxed Jinja; one that raises (`raise_exception('roles must alternate')`, or any error of
        its own) is a UserError with its message, never a crash."""
        try:
            return self.hf.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError and whatever the template's own expressions raise
            raise UserError(f"the model's chat template refused this conversation: {str(e)[:300]}") from None

    @cached_property
    def size(self) -> int:
        """Token ids it knows: [0, size) (added tokens included)."""
        return len(self.hf)

    @cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The text of every added (control) token: `<|im_start|>`, `<|im_end|>`, ..."""
        return tuple(self.hf.get_added_vocab())

    def is_rendered(self, text: str) -> bool:
        """True if `text` is a conversation already rendered by this model's chat template: it begins with the
        special token every rendering begins with (ChatML's `<|im_start|>`). Triton's own OpenAI frontend sends
        that; templating it again would wrap a whole conversation as one user message."""
        opening = self.template_opening
        return opening is not None and text.startswith(opening)

    @cached_property
    def template_opening(self) -> str | None:
        """The special token that begins every rendering of the chat template (None: no template, or it begins
        with ordinary text)."""
        if not self.has_chat_template:
            return None
        a, b = (self.render([{"role": "user", "content": c}]) for c in ("a", "b"))
        common = a[:next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))]
        ids = self.hf.encode(common, add_special_tokens=False)
        if not ids or ids[0] not in set(self.hf.all_special_ids):
            return None
        return self.hf.convert_ids_to_tokens(ids[0])

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a conversation the chat template already rendered: exactly what encode_prompt gives for
        the same conversation (no special tokens added)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token adds to the text (a part of a character for some: OpenAI's logprobs `bytes`). A
        byte-level BPE vocabulary maps each byte to one printable character (GPT-2's table); a SentencePiece one
        spells raw bytes <0xNN> and spaces as U+2581."""
        text = self.hf.decode([token], skip_special_tokens=True)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.hf.convert_ids_to_tokens(token)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        table = byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to."""
        return max(1, max(len(self.hf.decode([i]).encode()) for i in range(len(self.hf))))

    def max_text_bytes(self, context: int) -> int:
        """Bytes of text past which no prompt fits `context` tokens: a token covers at most the longest token's
        bytes, so a longer text has more tokens than the context. Checked before templating or tokenizing."""
        return context * self.longest_token_bytes

    def save(self, out: Path) -> list[Path]:
        """Write tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `out`."""
        out.mkdir(parents=True, exist_ok=True)
        return [Path(p) for p in self.hf.save_pretrained(str(out))]


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (each of the 256 bytes has one printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def text_delta(tok: Tokenizer, ids: list[int], sent: int, final: bool) -> str:
    """The text that `ids` adds to what `ids[:sent]` already streamed. A pure function of its arguments, so a
    stateless step (Triton's postprocessing) can stream: a non-final text holds back a trailing incomplete
    multi-byte character (decoded as U+FFFD) until the tokens completing it arrive; `final` flushes it."""
    before = tok.decode(ids[:sent]).rstrip("\ufffd") if sent else ""
    after = tok.decode(ids) if final else tok.decode(ids).rstrip("\ufffd")
    return after[len(before):]


class StreamDecoder:
    """Incremental detokenizer for a local stream: deltas that never split a multi-byte character."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.sent = tok, [], 0

    def feed(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        delta = text_delta(self.tok, self.ids, self.sent, final)
        self.sent = len(self.ids)
        return delta


def load_tokenizer(path: Path, kind: str, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
    """Tokenizer of a checkpoint: `kind` is "gguf" (path is the file) or "hf" (path is the directory)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable: never try
    from transformers import AutoTokenizer

    try:
        if kind == "hf" or path.is_dir():
            hf = AutoTokenizer.from_pretrained(str(path))
        else:
            cache = tokenizer_cache_dir(path)
            if (cache / "tokenizer.json").is_file():
                hf = AutoTokenizer.from_pretrained(str(cache))
            else:
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                with atomic.folder(cache) as tmp:  # a cache is whole or absent
                    hf.save_pretrained(str(tmp))
    except Exception as e:  # transformers and tokenizers raise many types for bad or hostile metadata
        raise UserError(f"cannot read a tokenizer from {path} ({type(e).__name__}: {str(e)[:300]}); it must hold "
                        "tokenizer files or GGUF tokenizer metadata") from None
    eos = set(eos_ids)
    if hf.eos_token_id is not None:
        eos.add(int(hf.eos_token_id))
    tok = Tokenizer(hf, frozenset(eos))
    if tok.has_chat_template:  # a template that fails on one user message fails every request: say so at load
        try:
            tok.render([{"role": "user", "content": "Hello"}])
        except UserError as e:
            raise UserError(f"{path}: {e} (one user message, 'Hello'): its chat template is broken; fix or "
                            "remove it (tokenizer.chat_template in a GGUF, chat_template in tokenizer_config.json)"
                            ) from None
    return tok


def tokenizer_cache_dir(gguf_file: Path) -> Path:
    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spork_trt" / "tokenizers"
    return root / key
