"""The decoding loop: propose -> score (prune, or gate) -> verify -> commit, streamed. Plain decoding is the same loop
without a drafter (each step's tree is the root alone), so both modes share one stop rule, one token accounting,
one code path."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import GenerateConfig, SpecConfig
from .engines import prefill
from .errors import UserError
from .sampling import make_generator, pick, processed_probs
from .scheduler import Scheduler
from .stats import Stats
from .stopping import StopState
from .tree import DraftTree, compile_tree
from .verifier import Scored, Verifier, gate_path
from .verify import Verdict, verify_greedy, verify_sampling

OnTokens = Callable[[list[int]], None]  # receives committed tokens as they are produced
# sees every target-verified step: (the proposed tree, the verifier's scores or None, the verdict over the tree)
Observe = Callable[[DraftTree, Scored | None, Verdict], None]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (EOS excluded)
    stop_reason: str  # "eos" | "stop_string" | "max_tokens"
    stats: Stats
    text: str | None = None  # set when a decode function was given


def budget(prompt_len: int, cfg: GenerateConfig, context: int) -> int:
    """New tokens allowed: max_new_tokens, clipped to the context window. Validates the prompt length."""
    if prompt_len == 0:
        raise UserError("the prompt encodes to no tokens: pass some text")
    if prompt_len >= context:
        raise UserError(f"the prompt has {prompt_len} tokens but the context window is {context}: shorten it")
    return min(cfg.max_new_tokens, context - prompt_len)


def generate(target, prompt_ids: list[int], cfg: GenerateConfig, eos_ids: frozenset[int],
             decode: Callable[[list[int]], str] | None = None, on_tokens: OnTokens | None = None,
             drafter=None, spec: SpecConfig = SpecConfig(), stats: Stats | None = None,
             verifier: Verifier | None = None, observe: Observe | None = None,
             busy: Callable[[], bool] | None = None) -> GenerationResult:
    """`stats`, when given, is filled in place as the loop runs (a streaming caller reads progress from it).
    `verifier` scores draft nodes (pruning; gate mode needs it); `observe` sees every verified step; `busy`
    (serving) makes steps plain while it returns True."""
    max_new = budget(len(prompt_ids), cfg, target.cfg.max_seq_len)
    stop, stats = StopState(eos_ids, max_new, cfg.stop_strings, decode), stats or Stats()
    gen, sched = make_generator(cfg.sampling.seed), Scheduler(spec, busy=busy)
    t0 = time.perf_counter()
    room = len(prompt_ids) + max_new + spec.tree_budget + spec.tree_depth + 1
    target.reset(room)
    root = pick(prefill(target, prompt_ids), cfg.sampling, gen)  # the first token is free
    if drafter is not None:
        drafter.reset(prompt_ids, room + spec.tree_depth, target)
    stats.prefill_s = time.perf_counter() - t0
    emit(stop, stats, on_tokens, [root], draft=0, accepted=0)
    behind: list[int] = []  # gate mode: committed tokens before the root that the target has not run yet
    can_score = verifier is not None and (verifier.head is not None or spec.verifier == "on")
    while stop.reason is None:
        t = time.perf_counter()
        speculate = drafter is not None and sched.speculate()
        proposed = drafter.propose(root, sched.shape()) if speculate else DraftTree.root_only(root)
        t_score = time.perf_counter()
        scoring = speculate and sched.use_verifier(can_score)
        scored = verifier.score(target, behind, proposed, sched.recent, [*prompt_ids, *stop.tokens],
                                len(prompt_ids)) if scoring else None
        gated = gate_path(proposed, scored, spec.gate_tau) if spec.gate_tau > 0 and scored else []
        t_verify = time.perf_counter()
        if gated:  # lossy gate mode: the verifier alone accepts; the target runs these tokens in its next pass
            tree, keep = proposed, list(range(len(proposed)))
            verdict = Verdict((0, *gated[:-1]), tuple(proposed.tokens[i] for i in gated[:-1]),
                              proposed.tokens[gated[-1]])
            behind += [proposed.tokens[i] for i in verdict.path]
        else:
            keep = sched.prune(proposed, cfg.sampling.greedy, None if scored is None else scored.survival)
            tree = proposed.subtree(keep)
            verdict = verify_tree(target, behind, tree, cfg, gen)
            behind = []
        if drafter is not None:
            drafter.commit(proposed, verdict.renumber(keep))
        t_end = time.perf_counter()
        stats.add_times(t_score - t, t_verify - t_score, t_end - t_verify, scored is not None)
        if observe is not None and not gated:
            observe(proposed, scored, verdict.renumber(keep))
        if not gated:
            sched.record(tree, verdict, speculate, t_verify - t, t_end - t_verify,
                         None if scored is None else t_verify - t_score)
        root = verdict.bonus
        emit(stop, stats, on_tokens, list(verdict.accepted) + [root], draft=0 if gated else len(tree) - 1,
             accepted=0 if gated else len(verdict.accepted), gated=len(gated))
    stats.time_s = time.perf_counter() - t0
    stats.fallbacks, stats.pruned_tokens, stats.verifier_offs = sched.fallbacks, sched.pruned, sched.verifier_offs
    stats.busy_steps = sched.busy_steps
    return GenerationResult(stop.tokens, stop.reason, stats, stop.text() if decode else None)


def verify_tree(target, behind: list[int], tree: DraftTree, cfg: GenerateConfig, gen: torch.Generator) -> Verdict:
    """One target forward over `behind` (committed, not yet run) + the tree; commit behind + the verdict's path."""
    b = len(behind)
    buf = compile_tree(tree.after(behind).parents, target.length)
    ids = torch.tensor([list(behind) + list(tree.tokens)])
    logits = target.forward(ids, buf.position_ids, buf.mask)[0][b:]  # [N, V]
    children = tuple(tuple(c - b for c in ch) for ch in buf.children[b:])
    verdict = verify(tree, children, logits, cfg, gen)
    target.commit(list(range(b)) + [b + i for i in verdict.path])
    return verdict


def verify(tree: DraftTree, children, logits: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator) -> Verdict:
    if cfg.sampling.greedy:
        return verify_greedy(tree, children, logits)
    return verify_sampling(tree, children, processed_probs(logits, cfg.sampling), gen)


def emit(stop: StopState, stats: Stats, on_tokens: OnTokens | None, committed: list[int], draft: int,
         accepted: int, gated: int = 0) -> None:
    """Apply the stop rule to a step's committed tokens, count the step, stream what is kept."""
    kept = stop.add(committed)
    if kept:
        stats.record_step(draft, accepted, gated)
        stats.committed_tokens += len(kept)
        if on_tokens:
            on_tokens(kept)
