"""A loaded model with its tokenizer and engine: what the CLI, the server and the bench run requests on."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import GenerateConfig
from .engines.torch_engine import TorchEngine
from .generate import GenerationResult, OnTokens, generate_plain
from .tokenizer import Tokenizer, load_tokenizer
from .weights import Checkpoint, load_checkpoint


@dataclass
class Runtime:
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    engine: TorchEngine

    @classmethod
    def load(cls, model: str | Path | None = None) -> "Runtime":
        ck = load_checkpoint(model)
        tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
        return cls(ck, tok, TorchEngine(ck.model))

    def generate(self, prompt_ids: list[int], cfg: GenerateConfig, mode: str = "plain",
                 on_tokens: OnTokens | None = None) -> GenerationResult:
        assert mode == "plain", mode
        return generate_plain(self.engine, prompt_ids, cfg, self.tokenizer.eos_ids, self.tokenizer.decode, on_tokens)
