"""Engines run one model over new tokens against preallocated KV caches.

Interface (the torch engine is the reference; ONNX Runtime and TensorRT engines follow it):
  make_pool(slots, max_len) -> KVPool              one preallocated buffer pair, a cache view per slot
  forward_batch([SeqInput]) -> [logits [r_b, V]]   a ragged batch: each sequence's new tokens after every row its
                                                   cache holds (committed + pending; `seen` may narrow the pending
                                                   rows each token attends: a model drafter's tree depths), with
                                                   its tree's own [n, n] ancestor mask; appends n_b pending
                                                   rows to each cache and returns logits at the rows it asks
                                                   for (`logit_rows`; all by default). One forward for all of
                                                   them (the engine pads to [B, T], or packs the tokens:
                                                   `padded_batches`; the LM head runs at the asked-for rows
                                                   only). The logits may stay on the engine's device (the
                                                   device engine's do): consumers take the argmax there and
                                                   copy to the host what needs it.
  forward_batch(seqs, hidden=[])                   also appends each sequence's hidden states [n_b, k*C] after
                                                   the engine's `taps` layers (the learned draft head's features;
                                                   only engines with taps, a target built with a head)
  forward(cache, input_ids [1,T], position_ids [1,T], mask [1,T,S], rows=None) -> logits [1, R, V]
                                                   one sequence over `cache` (a Rows): S = its length + pending
                                                   + T; appends T pending KV rows; R = the asked-for rows (None:
                                                   all T)
  make_cache(max_len) -> Rows                      one sequence's own buffers (a model drafter's draft cache)

An engine is stateless over the caches it is given: it holds weights (or a session) and scratch buffers, never a
sequence. Each request's rows are a pool slot, or a model drafter's own cache, passed in every SeqInput; the
caller keeps them (`Rows.commit`, `truncate`). `prefill` and `forward_chain` run a chain on one cache.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spork_trt.errors import UserError
from spork_trt.engines.kv_cache import KVPool, Rows
from spork_trt.checkpoint.manifest import engine_backend


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a ragged batch: new tokens after every row its cache holds."""

    cache: Rows  # the sequence's slot (or own cache): rows [0, length + pending) are its context
    tokens: tuple[int, ...]  # [n]
    positions: tuple[int, ...]  # [n]
    ancestors: torch.Tensor  # [n, n] bool: row i may attend new token j (itself and its ancestors)
    logit_rows: tuple[int, ...] | None = None  # rows (of the n) whose logits are wanted, ascending; None: all
    # [n, pending] bool: which of the cache's pending rows each new token attends (None: all of them). A model
    # drafter's depth sees only its own ancestors' rows among the tree levels it wrote before.
    seen: torch.Tensor | None = None

    @property
    def rows(self) -> list[int]:
        return list(range(len(self.tokens))) if self.logit_rows is None else list(self.logit_rows)

    @property
    def context(self) -> int:
        return self.cache.length + self.cache.pending

    def mask(self) -> torch.Tensor:
        """[1, n, context + n]: every committed row, the pending rows `seen`, then the tree's own ancestors."""
        n, c = len(self.tokens), self.cache
        seen = torch.ones(n, c.pending, dtype=torch.bool) if self.seen is None else self.seen
        return torch.cat([torch.ones(n, c.length, dtype=torch.bool), seen, self.ancestors], dim=1)[None]


@dataclass(frozen=True)
class Padded:
    """A ragged batch laid out for one forward: every sequence padded to the most new tokens T. The mask's columns
    are past rows [0, P) (P >= every context; a sequence sees only its own), then the T new ones; a padding row
    attends to itself only. `absolute` (the GQA graph, which appends each sequence's rows at its own context): the
    columns are absolute positions [0, S), S = the longest context + new tokens; a padding row attends to
    position 0 (its output is unused). `packed` (the GQA graph): the tokens are not padded but packed, input_ids
    and position_ids [1, N] (N = every sequence's new tokens, one after another); only the mask is [B, T, S]."""

    input_ids: torch.Tensor  # [B, T] (packed: [1, N])
    position_ids: torch.Tensor  # [B, T] (packed: [1, N])
    mask: torch.Tensor  # [B, T, P + T] bool (absolute: [B, T, S])
    context: list[int]  # [B] rows each sequence's cache holds
    logit_rows: torch.Tensor  # [R] flat indices b * T + t (packed: into [N]) of every sequence's asked-for rows (at
    # least one: row 0 stands in when none is asked for, so no engine sees an empty tensor)
    counts: list[int]  # [B] asked-for rows per sequence: logits [R, V] split by these
    starts: list[int] | None = None  # packed: [B] each sequence's first row of the N

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """logits [R, V] -> each sequence's [r_b, V]."""
        return list(torch.split(logits[:sum(self.counts)], self.counts))

    def rows(self, i: int, n: int) -> tuple:
        """Index of sequence i's n new tokens in a [B, T, ...] (packed: [1, N, ...]) output."""
        return (0, slice(self.starts[i], self.starts[i] + n)) if self.starts is not None else (i, slice(0, n))

    @classmethod
    def of(cls, seqs: list[SeqInput], past: int | None = None, absolute: bool = False,
           packed: bool = False) -> Padded:
        """`past`: P (default: the longest context)."""
        ctx = [s.context for s in seqs]
        for c, s in zip(ctx, seqs):
            if c + len(s.tokens) > s.cache.max_len:
                raise ValueError(f"KV cache full: {c + len(s.tokens)} positions needed, {s.cache.max_len} allocated")
        b, t, p = len(seqs), max(len(s.tokens) for s in seqs), max(ctx) if past is None else past
        width = max(c + len(s.tokens) for c, s in zip(ctx, seqs)) if absolute else p + t
        mask = torch.zeros(b, t, width, dtype=torch.bool)
        if not absolute:
            mask[:, torch.arange(t), p + torch.arange(t)] = True
        for i, s in enumerate(seqs):
            n, at = len(s.tokens), ctx[i] if absolute else p  # at: the column of the first new token
            mask[i, :n, :ctx[i]] = True
            if s.seen is not None:
                mask[i, :n, s.cache.length:ctx[i]] = s.seen
            mask[i, :n, at:at + n] = s.ancestors
            mask[i, n:, 0] |= absolute
        if packed:
            starts = [0, *itertools.accumulate(len(s.tokens) for s in seqs)][:-1]
            ids = torch.tensor([[x for s in seqs for x in s.tokens]], dtype=torch.long)  # [1, N]
            pos = torch.tensor([[x for s in seqs for x in s.positions]], dtype=torch.long)
            flat = [starts[i] + r for i, s in enumerate(seqs) for r in s.rows]
        else:
            starts, ids, pos = None, torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, :len(s.tokens)], pos[i, :len(s.tokens)] = torch.tensor(s.tokens), torch.tensor(s.positions)
            flat = [i * t + r for i, s in enumerate(seqs) for r in s.rows]
        return cls(ids, pos, mask, ctx, torch.tensor(flat or [0], dtype=torch.long), [len(s.rows) for s in seqs],
                   starts)


def chain_input(cache: Rows, ids: list[int], logit_rows: tuple[int, ...] | None = None) -> SeqInput:
    """Tokens as one causal chain after every row `cache` holds."""
    base, n = cache.length + cache.pending, len(ids)
    return SeqInput(cache, tuple(ids), tuple(range(base, base + n)), torch.ones(n, n, dtype=torch.bool).tril(),
                    logit_rows)


class Engine(ABC):
    """What every engine shares: a model run over KV caches it is given (it keeps none)."""

    # forward_batch pads every sequence to the longest ([B, T]): a batch costs B * T tokens, not their sum
    padded_batches: bool = True
    # a tree's row computes, bit for bit, what the same row computes in a chain. False (a quantized target on ONNX
    # Runtime: its int8 activations amplify the attention's summation order, which depends on where the row's
    # ancestors sit): the runtime drafts chains only, which are exact (row_invariance.py)
    exact_trees: bool = True
    taps: tuple[int, ...] = ()  # layers whose hidden states forward_batch can return (io_spec.HIDDEN)

    @property
    def chunks_apart(self) -> bool:
        """Prompt chunks run in a forward of their own, not beside the trees: in a padded batch a chunk would pad
        every tree to its length (the CPU torch engine packs its rows but pads its attention: it says so itself)."""
        return self.padded_batches

    @abstractmethod
    def make_cache(self, max_len: int) -> Rows:
        """Preallocated buffers for `max_len` positions."""

    @abstractmethod
    def make_pool(self, slots: int, max_len: int) -> KVPool:
        """One preallocated buffer pair for `slots` sequences of at most `max_len` positions."""

    def forward_batch(self, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor]:
        """Logits [r_b, V] at each sequence's asked-for rows; appends its new tokens as pending rows of its cache
        (and, given a `hidden` list, each sequence's hidden states [n_b, k*C] to it). This default runs the
        sequences one by one (engines override it with one padded forward)."""
        self.check_hidden(hidden)
        out = []
        for s in seqs:
            out.append(self.forward(s.cache, torch.tensor([s.tokens]), torch.tensor([s.positions]), s.mask(), s.rows,
                                    hidden)[0])
        return out

    @abstractmethod
    def forward(self, cache: Rows, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None, hidden: list | None = None) -> torch.Tensor:
        """One sequence over `cache`: input_ids, position_ids [1, T]; mask [1, T, length + pending + T] -> logits
        [1, R, V] at `rows` (None: all T); appends T pending rows to `cache`."""

    def check_hidden(self, hidden: list | None) -> None:
        if hidden is not None and not self.taps:
            raise UserError("this target engine outputs no hidden states (the learned draft head's features): "
                            "rebuild the engines with a draft head (`python -m export build --head ...`)")


def onnx_loader(path, entry: dict, cfg, providers: tuple[str, ...], target: bool = False) -> Engine:
    """An ONNX graph on ONNX Runtime with `providers`. A quantized `target` runs no forward of one row and verifies
    chains only (row_invariance.py)."""
    from spork_trt.engines.onnx_engine import OnnxEngine

    exact = not target or entry["precision"] == "fp32"
    engine = OnnxEngine(path, cfg, n_layers=entry["layers"], providers=providers, taps=tuple(entry.get("taps", ())),
                        min_rows=1 if exact else 2)
    engine.exact_trees = exact
    return engine


def tensorrt_loader(path, entry: dict, cfg, providers: tuple[str, ...], target: bool = False) -> Engine:
    """A TensorRT plan (`providers`, ONNX Runtime's, do not apply)."""
    from spork_trt.engines.trt_engine import TrtEngine

    return TrtEngine(path, cfg, n_layers=entry["layers"])


# a build's backend (its manifest entry's, manifest.engine_backend) -> (file, entry, cfg, providers, target) -> engine
LOADERS: dict[str, Callable[..., Engine]] = {"onnx": onnx_loader, "tensorrt": tensorrt_loader}


def load_engine(d, entry: dict, cfg, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                target: bool = False) -> Engine:
    """The engine for one manifest entry ({"path", "backend", "precision", "layers", ...}) of build folder `d`, by
    the backend its manifest names (`target`: the entry is the build's target)."""
    backend = engine_backend(entry)
    if backend not in LOADERS:
        raise UserError(f"{d / entry['path']} is built for backend {backend!r}, this runtime runs "
                        f"{', '.join(LOADERS)}: rebuild with `python -m export build --force`")
    return LOADERS[backend](d / entry["path"], entry, cfg, providers, target)


def forward_chain(engine, cache: Rows, ids: list[int], last: bool = False) -> torch.Tensor:
    """Run tokens as one causal chain after every row `cache` holds; returns logits [T, V], or [1, V] at the last
    token only when `last` (rows stay pending)."""
    return engine.forward_batch([chain_input(cache, ids, (len(ids) - 1,) if last else None)])[0]


def prefill(engine, cache: Rows, prompt_ids: list[int]) -> torch.Tensor:
    """Run a prompt on `cache` and commit it; returns the last position's logits [V]."""
    logits = forward_chain(engine, cache, prompt_ids, last=True)
    cache.commit()
    return logits[-1]
