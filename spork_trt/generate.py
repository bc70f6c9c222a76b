"""The decoding loop: propose -> score (prune) -> verify -> commit, streamed. Plain decoding is the same loop
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
from .verify import Verdict, verify_greedy, verify_sampling

OnTokens = Callable[[list[int]], None]  # receives committed tokens as they are produced


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
             drafter=None, spec: SpecConfig = SpecConfig(), stats: Stats | None = None) -> GenerationResult:
    """`stats`, when given, is filled in place as the loop runs (a streaming caller reads progress from it)."""
    max_new = budget(len(prompt_ids), cfg, target.cfg.max_seq_len)
    stop, stats = StopState(eos_ids, max_new, cfg.stop_strings, decode), stats or Stats()
    gen, sched = make_generator(cfg.sampling.seed), Scheduler(spec)
    t0 = time.perf_counter()
    room = len(prompt_ids) + max_new + spec.tree_budget + 1
    target.reset(room)
    root = pick(prefill(target, prompt_ids), cfg.sampling, gen)  # the first token is free
    if drafter is not None:
        drafter.reset(prompt_ids, room + spec.tree_depth)
    stats.prefill_s = time.perf_counter() - t0
    emit(stop, stats, on_tokens, [root], draft=0, accepted=0)
    while stop.reason is None:
        t = time.perf_counter()
        speculate = drafter is not None and sched.speculate()
        proposed = drafter.propose(root, sched.shape()) if speculate else DraftTree.root_only(root)
        keep = sched.prune(proposed, cfg.sampling.greedy)  # the nodes worth a target forward
        tree = proposed.subtree(keep)
        t_verify = time.perf_counter()
        buf = compile_tree(tree.parents, target.length)
        logits = target.forward(torch.tensor([tree.tokens]), buf.position_ids, buf.mask)[0]  # [N, V]
        verdict = verify(tree, buf.children, logits, cfg, gen)
        target.commit(list(verdict.path))
        if drafter is not None:
            drafter.commit(proposed, verdict.renumber(keep))
        t_end = time.perf_counter()
        stats.propose_s += t_verify - t
        stats.verify_s += t_end - t_verify
        sched.record(tree, verdict, speculate, t_verify - t, t_end - t_verify)
        root = verdict.bonus
        emit(stop, stats, on_tokens, list(verdict.accepted) + [root], draft=len(tree) - 1,
             accepted=len(verdict.accepted))
    stats.time_s = time.perf_counter() - t0
    stats.fallbacks, stats.pruned_tokens = sched.fallbacks, sched.pruned
    return GenerationResult(stop.tokens, stop.reason, stats, stop.text() if decode else None)


def verify(tree: DraftTree, children, logits: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator) -> Verdict:
    if cfg.sampling.greedy:
        return verify_greedy(tree, children, logits)
    return verify_sampling(tree, children, processed_probs(logits, cfg.sampling), gen)


def emit(stop: StopState, stats: Stats, on_tokens: OnTokens | None, committed: list[int], draft: int,
         accepted: int) -> None:
    """Apply the stop rule to a step's committed tokens, count the step, stream what is kept."""
    kept = stop.add(committed)
    if kept:
        stats.record_step(draft, accepted)
        stats.committed_tokens += len(kept)
        if on_tokens:
            on_tokens(kept)
