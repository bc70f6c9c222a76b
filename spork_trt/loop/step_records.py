"""What one step of the engine core hands from phase to phase, per request: the proposal before scoring (Plan),
the scored and priced proposal (Draft), what the target verifies (TreeWork), and the step's one forward (Forward)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spork_trt.engines import SeqInput
from spork_trt.spec.scheduler import Candidates
from spork_trt.spec.tree import DraftTree
from spork_trt.spec.verifier import Scored


@dataclass(frozen=True)
class Plan:
    """A decoding request's proposal before scoring."""

    proposed: DraftTree
    speculate: bool
    scoring: bool  # the verifier scores it
    propose_s: float


@dataclass
class Draft:
    """A decoding request's proposal this step."""

    proposed: DraftTree
    scored: Scored | None
    gated: list[int]  # gate mode: the path the verifier alone accepts (lossy); [] otherwise
    cands: Candidates | None  # what the allotment may verify (None when gated)
    speculated: bool
    propose_s: float
    score_s: float


@dataclass(frozen=True)
class Forward:
    """A step's target forward, by request."""

    logits: dict  # Request -> [r_b, V]: a tree's rows, or a prompt's last row (none for an earlier chunk)
    features: dict  # Request -> [n_b, k*C]: hidden states, for a drafter that wants them
    tree_s: float  # its seconds charged to verifying the trees
    prefill_s: float  # and to the prompt chunks


@dataclass(frozen=True)
class TreeWork:
    """What the target verifies for one request this step."""

    keep: list[int]  # verified nodes, as indices into the proposal (ascending, root first)
    tree: DraftTree  # the proposal cut to them
    children: tuple[tuple[int, ...], ...]  # [N] children of each node of `tree`
    seq: SeqInput  # the forward's input: gate mode's behind tokens, then `tree`
    masks: torch.Tensor | None = None  # [N, W] the grammar's bitmask at each node of `tree` (spec/grammar.py), or None
