"""Stop rule, applied to committed tokens only: EOS, stop strings, max new tokens.

A stop inside a multi-token commit truncates there, so every mode (plain or speculative) ends on exactly the same
tokens and text.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StopState:
    eos_ids: frozenset[int]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # needed only with stop strings
    tokens: list[int] = field(default_factory=list)  # generated so far (EOS excluded)
    reason: str | None = None  # "eos" | "stop_string" | "max_tokens" once stopped

    def __post_init__(self) -> None:
        assert not self.stop_strings or self.decode is not None, "stop strings need a decode function"

    def add(self, new: list[int]) -> list[int]:
        """Append committed tokens; return those kept (a prefix of `new`). Sets `reason` when generation ends."""
        kept: list[int] = []
        for t in new:
            if self.reason is not None:
                break
            if t in self.eos_ids:
                self.reason = "eos"
                break
            self.tokens.append(t)
            kept.append(t)
            if self.stop_strings and any(s in self.decode(self.tokens) for s in self.stop_strings):
                self.reason = "stop_string"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_tokens"
        return kept

    def text(self) -> str:
        """The generated text, cut before the first stop string."""
        assert self.decode is not None
        text = self.decode(self.tokens)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text
