"""Tokenizer and chat template, read from the same source as the weights (GGUF metadata or an HF directory).

transformers is used for tokenization only (never its modeling code). Converting a GGUF vocabulary takes seconds,
so the converted tokenizer is cached under ~/.cache/spork_trt keyed by the file's path, size and mtime; the cache
only saves time, it never changes a token.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError


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
        text = self.hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def save(self, out: Path) -> list[Path]:
        """Write tokenizer files (tokenizer.json, tokenizer_config.json, ...) into `out`."""
        out.mkdir(parents=True, exist_ok=True)
        return [Path(p) for p in self.hf.save_pretrained(str(out))]


class StreamDecoder:
    """Incremental detokenizer: text deltas that never split a multi-byte character or a merged word piece."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids = tok, []
        self.prefix, self.read = 0, 0  # ids[prefix:read] were decoded into text already emitted

    def feed(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


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
                hf.save_pretrained(str(cache))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read a tokenizer from {path} ({e}); it must hold tokenizer files or GGUF "
                        "tokenizer metadata") from None
    eos = set(eos_ids)
    if hf.eos_token_id is not None:
        eos.add(int(hf.eos_token_id))
    return Tokenizer(hf, frozenset(eos))


def tokenizer_cache_dir(gguf_file: Path) -> Path:
    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spork_trt" / "tokenizers"
    return root / key
