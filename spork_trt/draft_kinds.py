"""One table of drafter kinds, and the parser of `--draft`.

A `--draft` string is parsed once, at the edge, into a frozen `DraftSpec(kind, arg)`: `ngram` -> (NGRAM, ""),
`self-int8` -> (SELF, "int8"), `early-exit:8` -> (EARLY_EXIT, "8"), `model:PATH` -> (MODEL, PATH). Everything past
the edge reads the kind's row (its fields, or `spec.kind is EAGLE`), never the drafter's name. Data only, at the
bottom of the import graph: the runtime keeps the factories (runtime.DRAFTERS), drafters.py and eagle.py the classes.
"""
from __future__ import annotations

from dataclasses import dataclass

from spork_trt.errors import UserError

Shape = tuple[int, int, int]  # a tree: (width K: forks per node and nodes per depth, depth M, budget N: draft nodes)

# what a drafter needs besides the target engine
DATASTORE = "datastore"  # the build's datastore of the target's own text (Runtime.store)
HEAD = "head"  # the build's learned draft head, and a target engine that returns hidden states (Runtime.head)
ENGINE = "engine"  # a draft engine of its own (Runtime.draft_engine): the target quantized, its first layers, a model

# what follows a kind's name in `--draft`
NO_ARG = ""
QUANT = "Q"  # after "-": one of QUANTS (self-int8)
LAYERS = "N"  # after ":": how many of the target's first layers (early-exit:8)
PATH = "PATH"  # after ":": a checkpoint (model:PATH)

# quantized copies of the target (export/quantize.py says how each is made); `self-Q` drafts with copy Q
QUANTS = ("int8", "int4", "int8-dynamic", "int8-static", "fp8")


@dataclass(frozen=True, eq=False)  # rows are singletons: compared by identity (`spec.kind is SELF`)
class DraftKind:
    name: str  # what `--draft` starts with
    shape: Shape  # the default tree, measured with `python -m bench run` (README)
    arg: str = NO_ARG  # NO_ARG | QUANT | LAYERS | PATH
    needs: frozenset[str] = frozenset()  # DATASTORE | HEAD | ENGINE: what it needs itself
    parts: tuple[DraftSpec, ...] = ()  # a combined drafter's parts, each a drafter of its own (with its own needs)
    # takes the target's prompt KV rows instead of running the prompt: exact for early exit, close for a quantized
    # copy (only draft quality depends on it)
    shares_prompt: bool = False
    batched: bool = False  # proposes through `proposing`: each draft depth of every request is one batched forward
    wants_hidden: bool = False  # reads the target's hidden states of every committed token (`observe`)
    grafted: int = 0  # draft nodes a step's tree may hold past the spec's budget (a second tree grafted on)
    arg_shapes: tuple[tuple[str, Shape], ...] = ()  # (arg, shape) where an argument drafts its own default tree

    @property
    def sep(self) -> str:
        return "-" if self.arg == QUANT else ":"

    def spellings(self) -> tuple[str, ...]:
        """What users type for this kind (`self-int8`, ..., `early-exit:N`)."""
        if self.arg == QUANT:
            return tuple(f"{self.name}-{q}" for q in QUANTS)
        return (self.name + (self.sep + self.arg if self.arg else ""),)

    def shape_for(self, arg: str) -> Shape:
        return dict(self.arg_shapes).get(arg, self.shape)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed `--draft`: its kind's row and the argument after the name (a quantization, a layer count, a path)."""

    kind: DraftKind
    arg: str = ""

    def __str__(self) -> str:
        """The `--draft` text (build manifests, calibrated heads and results are keyed by it)."""
        return self.kind.name + (self.kind.sep + self.arg if self.arg else "")

    @property
    def shape(self) -> Shape:
        return self.kind.shape_for(self.arg)


# Model drafters pay per depth, so they draft chains; n-gram lookups are free, so they draft wider trees.
NGRAM = DraftKind("ngram", (3, 6, 12))  # prompt lookup in the request's own text
STORE = DraftKind("store", (3, 6, 12), needs=frozenset({DATASTORE}))  # + the datastore where the text has too few
# the learned head: a narrow tree (a CPU target pays for every node it verifies)
EAGLE = DraftKind("eagle", (2, 4, 6), needs=frozenset({HEAD}), wants_hidden=True)
# the store's tree alone on long matches, else the head's grafted on; the shape is the store part's (the head drafts
# with eagle's, cut to the current depth)
STORE_EAGLE = DraftKind("store-eagle", (3, 6, 12), parts=(DraftSpec(STORE), DraftSpec(EAGLE)), wants_hidden=True,
                        grafted=EAGLE.shape[2])
# the target's quantized copies; only int8 and int4 were swept: the others draft chains as short as int4's, since
# they agree less with the target than int8 (README)
SELF = DraftKind("self", (1, 3, 3), QUANT, frozenset({ENGINE}), shares_prompt=True, batched=True,
                 arg_shapes=(("int8", (1, 5, 5)),))
# n-gram drafts on repeated text, else self-int8's: the shape is the n-gram part's (self-int8 drafts with its own)
HYBRID = DraftKind("hybrid", (3, 6, 12), parts=(DraftSpec(NGRAM), DraftSpec(SELF, "int8")), batched=True)
EARLY_EXIT = DraftKind("early-exit", (2, 2, 4), LAYERS, frozenset({ENGINE}), shares_prompt=True, batched=True)
MODEL = DraftKind("model", (1, 4, 4), PATH, frozenset({ENGINE}), batched=True)  # a checkpoint sharing the tokenizer
# the best measured drafter a runtime has: store with a datastore, else ngram (README); resolved by the runtime
AUTO = DraftKind("auto", NGRAM.shape)

KINDS = (AUTO, NGRAM, STORE, EAGLE, STORE_EAGLE, HYBRID, SELF, EARLY_EXIT, MODEL)
AUTO_DRAFT = AUTO.name
SELF_DRAFTS = SELF.spellings()
DRAFT_HELP = " | ".join(s for kind in KINDS for s in kind.spellings())
# the default tree by what precedes ":" (`ngram`, `self-int8`, `early-exit`, ...)
SHAPES = ({kind.name: kind.shape for kind in KINDS if kind.arg != QUANT}
          | {f"{kind.name}{kind.sep}{q}": kind.shape_for(q) for kind in KINDS if kind.arg == QUANT for q in QUANTS})


def parse_draft(text: str | DraftSpec, n_layers: int | None = None) -> DraftSpec:
    """Validate a `--draft` value; `n_layers` (the target's, where known) bounds early-exit:N."""
    text = str(text)  # a DraftSpec: checked again against n_layers
    head, colon, arg = text.partition(":")
    for kind in KINDS:
        quant = head[len(kind.name) + 1:]
        if kind.arg == QUANT and not colon and head == kind.name + kind.sep + quant and quant in QUANTS:
            return DraftSpec(kind, quant)
        if head != kind.name:
            continue
        if kind.arg == NO_ARG and not colon:
            return DraftSpec(kind)
        if kind.arg == LAYERS:
            if arg.isdigit() and 1 <= int(arg) and (n_layers is None or int(arg) < n_layers):
                return DraftSpec(kind, arg)
            if n_layers is None:
                raise UserError(f"--draft {kind.name}:N needs N, how many of the target's first layers draft (1 or "
                                "more, fewer than the target has)")
            raise UserError(f"--draft {kind.name}:N needs N in 1..{n_layers - 1} (the target has {n_layers} "
                            "layers)")
        if kind.arg == PATH and arg:
            return DraftSpec(kind, arg)
    raise UserError(f"unknown --draft {text!r}: use {DRAFT_HELP}")


def default_shape(text: str) -> Shape:
    """The default tree of a --draft value, unchecked (an unknown one: ngram's; parse_draft refuses it)."""
    return SHAPES.get(text.partition(":")[0], NGRAM.shape)


def tree_room(text: str, budget: int, depth: int) -> int:
    """KV positions past the context one step of a --draft value's trees may take: its draft nodes (the budget and
    what its kind grafts past it), the catch-up tokens (at most the depth) and the root."""
    kind = next((k for k in KINDS if k.name == text.partition(":")[0]), NGRAM)
    return budget + kind.grafted + depth + 1


def resolve(text: str, default: str) -> str:
    """A --draft value with `auto` replaced by `default` (the runtime's best drafter); others as they are."""
    return default if text == AUTO.name else text


def is_kind(text: str, kind: DraftKind) -> bool:
    """Whether `text` is a valid --draft value of `kind`."""
    try:
        return parse_draft(text).kind is kind
    except UserError:
        return False


def named(names, kind: DraftKind) -> list[str]:
    """Those of `names` (a build's engines, ...) that are --draft values of `kind`, in order."""
    return [name for name in names if is_kind(name, kind)]
