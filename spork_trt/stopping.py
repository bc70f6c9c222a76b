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
        # a stop string of L characters that first appears with the latest token lies within its last 4L + 2
        # tokens (a token adds at least one byte, a character is at most 4): only that tail is decoded per token
        self.window = 4 * max(map(len, self.stop_strings), default=0) + 2

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
            if self.stop_strings and self.stopped(self.decode(self.tokens[-self.window:])):
                self.reason = "stop_string"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_tokens"
        return kept

    def stopped(self, tail: str) -> bool:
        return any(s in tail for s in self.stop_strings)

    def text(self) -> str:
        """The generated text, cut before the first stop string."""
        assert self.decode is not None
        text = self.decode(self.tokens)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text
