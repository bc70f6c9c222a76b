"""Prompt sets (spork_trt.prompts) and the git sha every benchmark record carries."""
from __future__ import annotations

import subprocess

from spork_trt.prompts import load_prompts

__all__ = ["git_sha", "load_prompts"]


def git_sha() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"
