"""Constrained decoding: a grammar (any JSON, a JSON schema, a regex, an EBNF grammar) restricts the target's
distribution at every committed position, so the reference is constrained plain decoding, greedy or sampled.

The grammar engine is xgrammar (maintained, on the package index; chosen by measurement over llguidance, on the
default tokenizer, a three-field JSON schema and one 39-token document: a next-token mask in 0.02 ms against 0.14 ms
on average, 0.19 ms against 2.9 ms at worst; compiling 15 ms against 3 ms; installed without its optional GPU
kernels). Under speculation every draft tree is walked with the grammar before verification (`tree_masks`): a node whose token the grammar forbids at its place is
cut with its subtree (it never costs a forward slot), and each kept node gets the mask of the grammar state its path
reaches; the target's logits at each node are masked with it (`constrain`) before greedy or sampled verification,
which then accepts exactly what constrained plain decoding would. After a step the committed tokens advance the
grammar (`advance`).

  tree_masks   DraftTree [N] -> valid [N] bools, masks [N, ceil(V/32)] int32 bitmasks (bit t: token t allowed)
  constrain    logits [N, V], masks [N, W] -> logits [N, V] with forbidden tokens at -inf
"""
from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass

import torch

from spork_trt.errors import UserError
from spork_trt.spec.schema_check import check_schema
from spork_trt.spec.tree import DraftTree, graft

KINDS = ("json", "json_schema", "regex", "ebnf")
SEPARATORS = (", ", ": ")  # a schema's documents: one layout (json.dumps'), no free whitespace (below)
SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match."""

    kind: str  # one of KINDS
    source: str = ""  # the JSON schema (as JSON text), the regex or the EBNF grammar; "" for any JSON

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json" and not self.source.strip():
            raise UserError(f"a {self.kind} grammar needs its source (the schema, regex or EBNF text)")


def parse_grammar(text: str) -> GrammarSpec:
    """The `grammar` request tensor: {"kind": one of KINDS, "source": text} as JSON -> a GrammarSpec."""
    import json

    try:
        obj = json.loads(text)
    except ValueError:
        raise UserError('grammar must be JSON: {"kind": "json" | "json_schema" | "regex" | "ebnf", "source": TEXT}') from None
    if not isinstance(obj, dict) or set(obj) - {"kind", "source"} or not isinstance(obj.get("source", ""), str):
        raise UserError('grammar must be {"kind": "json" | "json_schema" | "regex" | "ebnf", "source": TEXT}')
    return GrammarSpec(str(obj.get("kind")), obj.get("source", ""))


def grammar_text(spec: GrammarSpec) -> str:
    """A GrammarSpec as the `grammar` request tensor's JSON."""
    import json

    return json.dumps({"kind": spec.kind, "source": spec.source})


class Grammars:
    """One tokenizer's grammar compiler (its vocabulary prepared once; compiled grammars cached)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)

    @functools.lru_cache(maxsize=64)
    def compiled(self, spec: GrammarSpec):
        try:
            if spec.kind == "json":
                return self.compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                check_schema(spec.source)  # keywords it would ignore: refused by name
                return self.compiler.compile_json_schema(spec.source, strict_mode=True, any_whitespace=False,
                                                         separators=SEPARATORS)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            return self.compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors: the user's schema, regex or grammar
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = SOURCE_PREFIX.sub("", first)  # xgrammar's "[hh:mm:ss] /its/source.cc:123: ": not the client's
            raise UserError(f"the {spec.kind} grammar does not compile: {first[:300]}") from None

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh grammar state for one request."""
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)


def timed(method):
    """A Constraint method whose time is added to its `spent_s`."""
    @functools.wraps(method)
    def run(self, *args):
        t = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.spent_s += time.perf_counter() - t
    return run


class Constraint:
    """One request's grammar state: advanced by its committed tokens, walked along its draft trees."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher, self.vocab_size = matcher, vocab_size
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]
        self.spent_s = 0.0  # time in the grammar engine and masking, over this request (its Stats.grammar_s)

    def masks(self, n: int) -> torch.Tensor:
        return torch.full((n, self.width), -1, dtype=torch.int32)  # every bit set: all allowed

    @timed
    def next_mask(self) -> torch.Tensor:
        """[1, W]: what the grammar allows after the committed tokens."""
        out = self.masks(1)
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(out, 0)
        return out

    @timed
    def tree_masks(self, tree: DraftTree) -> tuple[list[bool], torch.Tensor]:
        """valid [N] (a node and all its ancestors allowed where they stand) and masks [N, W] (each valid node's
        state's mask; an invalid node's row is all ones and never used), by a depth-first walk with rollback: the
        grammar state is left as it was."""
        n = len(tree)
        valid, masks = [False] * n, self.masks(n)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[tree.parents[i]].append(i)
        valid[0] = True
        stack: list[tuple[int, bool]] = [(0, False)]  # (node, leaving): entering takes its token and fills its mask,
        # leaving rolls the token back (pushed before its children, so popped after them)
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.matcher.rollback(1)
                continue
            if node:
                if not self.matcher.accept_token(tree.tokens[node]):
                    continue  # its parent's mask allowed it, so this does not happen; invalid if it did
                valid[node] = True
                stack.append((node, True))
            if self.matcher.is_terminated():
                continue  # nothing may follow the end: its children stay invalid
            self.matcher.fill_next_token_bitmask(masks, node)
            stack += [(c, False) for c in reversed(children[node]) if allowed(masks[node], tree.tokens[c])]
        return valid, masks

    @timed
    def forced(self, limit: int, stop_ids: frozenset[int]) -> list[int]:
        """The tokens the grammar allows alone from here, in order (at most `limit`; never a stop token: the end is
        left to the model's own turn): each is the only token a masked distribution can give, so committing it
        without a verdict changes nothing (jump-forward). The grammar state is left as it was."""
        out: list[int] = []
        mask = self.masks(1)
        while len(out) < limit and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(mask, 0)
            only = single_bit(mask[0], self.vocab_size)
            if only is None or only in stop_ids or not self.matcher.accept_token(only):
                break
            out.append(only)
        if out:
            self.matcher.rollback(len(out))
        return out

    @timed
    def chain(self, limit: int) -> list[int]:
        """The continuation the grammar forces from here as xgrammar spells it (the longest vocabulary tokens; the
        model may spell it otherwise), at most `limit` tokens: a free draft for the target to verify (`forced`
        commits without a verdict only what no other token can give). The grammar state is left as it was."""
        if self.matcher.is_terminated():
            return []
        return list(self.matcher.find_jump_forward_tokens())[:limit]

    @timed
    def constrain(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """constrain() below, timed as this request's grammar work."""
        return constrain(logits, masks)

    @timed
    def advance(self, tokens: list[int]) -> None:
        """The committed tokens, in order (those after the grammar's end are ignored: the stop rule ends there)."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(t):
                raise AssertionError(f"a committed token ({t}) breaks the grammar: masked decoding never picks one")


def with_chain(tree: DraftTree, constraint: Constraint, limit: int) -> DraftTree:
    """A deterministic draft tree with the grammar's forced continuation grafted under its root as a chain (a source
    of its own, so the scheduler learns its odds apart): keys, punctuation and enum tails a drafter did not guess."""
    chain = constraint.chain(limit)
    if not chain or tree.q is not None:
        return tree
    return graft(tree, DraftTree((tree.tokens[0], *chain), tuple(range(-1, len(chain)))), len(tree) - 1 + len(chain))


def single_bit(mask: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a bitmask row [W] allows, or None when it allows none or several."""
    words = torch.nonzero(mask).reshape(-1)
    if words.numel() != 1:
        return None
    w = int(words[0])
    bits = int(mask[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    token = 32 * w + bits.bit_length() - 1
    return token if token < vocab_size else None


def allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether bit `token` of one bitmask row [W] is set."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def constrain(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with each row's forbidden tokens at -inf (masks [N, W] int32 bitmasks)."""
    v = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (masks[:, :, None] >> shifts) & 1  # [N, W, 32]
    ok = bits.reshape(masks.shape[0], -1)[:, :v].bool().to(logits.device)  # [N, V]
    return logits.masked_fill(~ok, float("-inf"))
