"""Benchmark arms: `plain`, `spork/DRAFT[/KxMxN][/fixed][/verifier]` (tree width x depth x budget; `fixed`: the
scheduler's cost-aware pruning and depth changes off; `verifier`: the calibrated verifier scores every step,
`noverifier`: never; `acceptX`: the acceptance rate tau steers toward), e.g. `spork/self-int8/2x5x10`,
`spork/ngram/fixed/verifier`; `gate/DRAFT/TAU` (lossy gate mode, e.g. `gate/ngram/0.5`); or a peer:
`peer/hf-greedy`, `peer/hf-prompt-lookup`, `peer/llama-cpp[-q8_0|-q4_0][-prompt-lookup][-repack]`, `peer/ort-genai`
(bench/peers.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from spork_trt.config import SpecConfig
from spork_trt.errors import UserError


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str  # "plain" | "spork" | "gate" | "peer"
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
    if parts[0] == "gate":
        try:
            tau = float(parts[2]) if len(parts) == 3 else -1.0
        except ValueError:
            tau = -1.0
        if not 0 < tau <= 1:
            raise UserError(f"bad arm {name!r}: use gate/DRAFT/TAU with TAU in (0, 1], e.g. gate/ngram/0.5")
        return Arm(name, "gate", SpecConfig.for_draft(parts[1], gate_tau=tau))
    flags = {"fixed": False, "verifier": False, "noverifier": False}
    target_acceptance = None
    while parts[-1] in flags or parts[-1].startswith("accept"):
        last = parts.pop()
        if last in flags:
            flags[last] = True
            continue
        try:
            target_acceptance = float(last[len("accept"):])
        except ValueError:
            raise UserError(f"bad arm {name!r}: write the verifier's target acceptance as acceptX, e.g. accept0.5"
                            ) from None
    if parts[0] != "spork" or len(parts) not in (2, 3):
        raise UserError(f"bad arm {name!r}: use plain, spork/DRAFT[/KxMxN][/fixed][/verifier][/acceptX] or "
                        "gate/DRAFT/TAU, "
                        "e.g. spork/ngram/3x6x12")
    spec = SpecConfig.for_draft(parts[1])
    if len(parts) == 3:
        try:
            k, m, n = (int(x) for x in parts[2].split("x"))
        except ValueError:
            raise UserError(f"bad tree shape in arm {name!r}: write width x depth x budget, e.g. 2x5x10") from None
        spec = SpecConfig(draft=parts[1], tree_width=k, tree_depth=m, tree_budget=n)
    verifier = "on" if flags["verifier"] else "off" if flags["noverifier"] else spec.verifier
    spec = replace(spec, adaptive=not flags["fixed"], verifier=verifier)
    if target_acceptance is not None:
        spec = replace(spec, target_acceptance=target_acceptance)
    return Arm(name, "spork", spec)
