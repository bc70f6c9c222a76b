"""Prompt sets (spork_trt.prompts), the git sha every benchmark record carries, and the comma list of load levels
(--concurrency) the load benchmarks take."""
from __future__ import annotations

import subprocess

from spork_trt.errors import UserError
from spork_trt.prompts import load_prompts

__all__ = ["git_sha", "levels_arg", "load_prompts"]


def git_sha() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def levels_arg(text: str, flag: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c]
    except ValueError:
        levels = []
    if not levels or any(c < 1 for c in levels):
        raise UserError(f"{flag} takes a comma list of positive integers, got {text!r}")
    return levels
