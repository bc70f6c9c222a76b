"""Benchmark arms: `plain`, `spork/DRAFT[/KxMxN][/fixed]` (tree width x depth x budget; `fixed`: the scheduler's
cost-aware pruning and depth changes off), e.g. `spork/self-int8/2x5x10`, `spork/ngram/fixed`, or a peer:
`peer/hf-greedy`, `peer/hf-prompt-lookup` (transformers generate from the same checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from spork_trt.config import SpecConfig
from spork_trt.errors import UserError


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str  # "plain" | "spork" | "peer"
    spec: SpecConfig
    peer: str = ""  # bench/peers.py PEERS key, mode "peer" only


def parse_arm(name: str) -> Arm:
    if name == "plain":
        return Arm(name, "plain", SpecConfig())
    if name.startswith("peer/"):
        from .peers import PEERS

        if name[5:] not in PEERS:
            raise UserError(f"unknown peer arm {name!r}: use {', '.join('peer/' + p for p in PEERS)}")
        return Arm(name, "peer", SpecConfig(), name[5:])
    parts = name.split("/")
    fixed = parts[-1] == "fixed"
    parts = parts[:-1] if fixed else parts
    if parts[0] != "spork" or len(parts) not in (2, 3):
        raise UserError(f"bad arm {name!r}: use plain or spork/DRAFT[/KxMxN][/fixed], e.g. spork/ngram/3x6x12")
    spec = SpecConfig.for_draft(parts[1])
    if len(parts) == 3:
        try:
            k, m, n = (int(x) for x in parts[2].split("x"))
        except ValueError:
            raise UserError(f"bad tree shape in arm {name!r}: write width x depth x budget, e.g. 2x5x10") from None
        spec = SpecConfig(draft=parts[1], tree_width=k, tree_depth=m, tree_budget=n)
    return Arm(name, "spork", replace(spec, adaptive=not fixed))
