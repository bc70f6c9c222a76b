"""A loaded target with its tokenizer, engine and draft engines: what the CLI, the server and the bench run on.

Two backends behind the same engine interface: `torch` (the reference, from a checkpoint) and `onnx` (ONNX Runtime,
from engines built by `python -m export build`)."""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from spork_trt.config import (AUTO_DTYPE, CPU_TORCH_DTYPES, DEVICE_DTYPE, DEVICE_DTYPES, VERIFIER_LAYERS, GenerateConfig,
                     ModelConfig, SamplingConfig, SpecConfig)
from spork_trt.loop.request import Submission
from spork_trt.spec.datastore import Datastore
from spork_trt.draft_kinds import (
    DATASTORE,
    EAGLE,
    EARLY_EXIT,
    ENGINE,
    HEAD,
    HYBRID,
    KINDS,
    MODEL,
    NGRAM,
    SELF,
    STORE,
    STORE_EAGLE,
    DraftKind,
    DraftSpec,
    named,
    parse_draft,
    resolve,
)
from spork_trt.spec.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, StoreDrafter
from spork_trt.spec.eagle import EagleDrafter, StoreHeadDrafter, lookup
from spork_trt.engines.default_target import default_target, source_path
from spork_trt.errors import UserError
from spork_trt.loop.generate import GenerationResult, OnTokens, run_alone
from spork_trt.spec.grammar import Grammars, GrammarSpec
from spork_trt.spec.logprobs import MAX_TOP
from spork_trt.spec.sampling import make_generator
from spork_trt.loop.stats import Stats
from spork_trt.checkpoint.tokenizer import Tokenizer, load_tokenizer
from spork_trt.spec.verifier import ConfidenceHead, Verifier, load_heads
from spork_trt.checkpoint.weights import load_checkpoint

MODES = ("plain", "spork", "gate")


@dataclass(frozen=True)
class TargetName:
    """Which model answers: the same three fields on two runs mean the same target, the same tokens from plain
    decoding (the `--json` stats' "target" and every startup line)."""

    precision: str  # fp32 | bf16 | int4 | a build's ONNX precision (int8, ...)
    engine: str  # "PyTorch reference" | "ONNX Runtime" | "CPU torch engine" | "device engine (cuda)" | ...
    kernels: str  # the arithmetic that computes it: int4_kernel.arithmetic(), "onednn-bf16", or "" (the engine's)

    def line(self) -> str:
        return f"{self.precision} on the {self.engine}" + (f", {self.kernels} kernels" if self.kernels else "")

    def to_json(self) -> dict:
        return asdict(self)


def target_name(backend: str, precision: str) -> TargetName:
    """The TargetName of a Runtime's backend ("torch", "onnx", "tensorrt", "torch-DEVICE-DTYPE")."""
    engines = {"torch": "PyTorch reference", "onnx": "ONNX Runtime", "tensorrt": "TensorRT"}
    if backend in engines:
        return TargetName(precision, engines[backend], "")
    _, device, dtype = backend.split("-", 2)
    if device != "cpu":
        return TargetName(dtype, f"device engine ({device})", "")
    from spork_trt.engines.cpu.kernels import arithmetic

    return TargetName(dtype, "CPU torch engine", arithmetic() if dtype == "int4" else "onednn-bf16")


@dataclass
class Runtime:
    cfg: ModelConfig
    tokenizer: Tokenizer
    engine: object  # the target engine
    build_draft_engine: Callable[[DraftSpec], object]  # a draft engine (kinds that need an ENGINE)
    backend: str = "torch"
    verifier_layers: int = VERIFIER_LAYERS  # the early-layer verifier (and early-exit draft) of this build
    heads: dict[str, ConfidenceHead] = field(default_factory=dict)  # the verifier's calibrated heads, by drafter
    draft_engines: dict[str, object] = field(default_factory=dict)  # built once per draft kind
    store: Datastore | None = None  # the build's datastore of the target's own text (--draft store)
    # the build's learned draft head, the target's embeddings and the head's ONNX step or None (--draft eagle)
    head: tuple | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # concurrent requests build once
    precision: str = "fp32"  # the target's: a build's ONNX precision, or the torch engine's dtype

    @property
    def target(self) -> TargetName:
        return target_name(self.backend, self.precision)

    @classmethod
    def load(cls, model: str | Path | None = None, device: str = "cpu", dtype: str = DEVICE_DTYPE) -> Runtime:
        """The torch reference engine, from a checkpoint (None: the embedded default); on another `device` (cuda) or
        `dtype` the target runs in `dtype` (fp32 | fp16 | bf16) on the device engine, or on the CPU in bf16 or
        int4 on the CPU torch engine (torch_target)."""
        from spork_trt.engines.torch_engine import TorchEngine
        from spork_trt.checkpoint.quant_copies import int4_copy, int8_copy

        if device != "cpu":
            from spork_trt.engines.device_engine import require_device

            require_device(device)  # one clear line, before the checkpoint loads
        ck = load_checkpoint(model)
        tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)

        copies = {"int8": int8_copy, "int4": int4_copy}  # the torch engine's own quantized copies (quant_copies.py)

        def draft_engine(d: DraftSpec):
            if d.kind is SELF and d.arg in copies:
                return TorchEngine(copies[d.arg](ck.model))
            if d.kind is EARLY_EXIT:
                return TorchEngine(ck.model, exit_layer=int(d.arg))
            if d.kind is SELF:
                raise UserError(f"--draft {d} runs on ONNX Runtime engines: build them with `python -m export "
                                f"build --draft {d}` and pass --engines (the torch engine has "
                                f"{', '.join(str(DraftSpec(SELF, q)) for q in copies)})")
            assert d.kind is MODEL, d
            draft = load_checkpoint(d.arg)
            check_same_tokenizer(tok, load_tokenizer(draft.path, draft.kind, draft.cfg.eos_token_ids),
                                 ck.cfg.vocab_size, draft.cfg.vocab_size, d.arg)
            return TorchEngine(draft.model)

        if device == "cpu" and dtype == "fp32":
            return cls(ck.cfg, tok, TorchEngine(ck.model), draft_engine, "torch")
        return cls(ck.cfg, tok, torch_target(ck, device, dtype), draft_engine, f"torch-{device}-{dtype}",
                   precision=dtype)

    @classmethod
    def from_build(cls, engines: str | Path, dtype: str, verify: bool = False) -> Runtime:
        """A build with its target in a `--dtype` (fp32: its ONNX target; bf16, int4: its checkpoint on the CPU torch
        engine; auto: the build's default target on this host)."""
        return cls.from_engines(engines, device=build_target_device(dtype), dtype=dtype, verify=verify)

    @classmethod
    def from_engines(cls, engines: str | Path, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                     load_head: bool = True, device: str | None = None, dtype: str = DEVICE_DTYPE, verify: bool = False
                     ) -> Runtime:
        """Engines built by `python -m export build` (ONNX Runtime on the given execution providers; TensorRT plans
        where the build made them); with the verifier's confidence heads `export calibrate` wrote (unless not
        `load_head`). `device` (cuda; cpu runs the same code eagerly, bf16 on oneDNN's kernels): the target runs
        from the build's source checkpoint in `dtype` (torch_target), the build's tokenizer, datastore and draft
        head around it (no early-layer verifier: its engine reads the target's cache); `dtype` auto: the build's
        default target on this host (resolve_target). A build whose files do not match its manifest is refused
        (sizes; sha256 too when `verify`: manifest.read)."""
        from spork_trt.engines import load_engine
        from spork_trt.checkpoint import manifest as mf

        d = Path(engines)
        m = mf.read(d, verify)
        device, dtype = resolve_target(m, device, dtype)
        cfg = mf.spec_config(m["model"])
        tok = load_tokenizer(d, "hf", cfg.eos_token_ids)
        built = m["engines"]
        if device is not None:
            from spork_trt.engines.device_engine import require_device

            from spork_trt.engines.cpu.engine import built_on_one_thread

            require_device(device)  # one clear line, before the checkpoint loads
            with built_on_one_thread():  # its forwards may run on another thread (the server's engine core)
                taps = tuple(built["target"].get("taps", ()))
                target = torch_target(source_checkpoint(m), device, dtype, taps)
            m = {**m, "backend": f"torch-{device}-{dtype}"}

        def draft_engine(draft: DraftSpec):
            layers = built["verifier"]["layers"]  # an early-exit draft of as many layers shares its engine
            if device is not None and draft.kind is EARLY_EXIT:
                raise UserError("the early-layer verifier runs on the target's own cache, and early-exit drafts "
                                "share its engine: not with the device engine (use ngram, store, eagle or a "
                                "self-draft)")
            if draft.kind is SELF and str(draft) in built:  # a build keeps its quantized copies by --draft value
                return load_engine(d, built[str(draft)], cfg, providers)
            if draft.kind is EARLY_EXIT and int(draft.arg) == layers:
                return load_engine(d, built["verifier"], cfg, providers)
            have = [*named(built, SELF), str(DraftSpec(EARLY_EXIT, str(layers)))]
            raise UserError(f"{d} has no engine for --draft {draft}: built drafts are "
                            f"{NGRAM.name}, {', '.join(have)} (rebuild with `python -m export build` to add others)")

        if device is None:
            target = load_engine(d, built["target"], cfg, providers, target=True)
        layers = built["verifier"]["layers"]
        heads = load_heads(d, layers) if load_head and device is None else {}  # the verifier: not on a device
        store = Datastore.load(d) if "store" in built else None  # the manifest's engine entries, not drafter names
        head = None
        if "head" in built:
            import numpy as np

            from spork_trt.spec.draft_head import load_head

            head_model = load_head(d / built["head"]["path"])[0]
            step = None  # a head's step has an ONNX graph (eagle1 since graph layout lean-4, eagle3 lean-5)
            if built["head"].get("graph"):
                from spork_trt.engines.onnx_head import OnnxHead

                step = OnnxHead(d / built["head"]["graph"], head_model.hc.layer_config())
            head = (head_model, lookup(np.load(d / built["head"]["embeddings"], mmap_mode="r", allow_pickle=False)),
                    step)
        return cls(cfg, tok, target, draft_engine, m["backend"], layers, heads, store=store, head=head,
                   precision=dtype if device is not None else built["target"]["precision"])

    @property
    def default_draft(self) -> str:
        """What `--draft auto` means here: the best measured drafter this runtime has (README, Learned drafts)."""
        return STORE.name if self.store is not None else NGRAM.name

    def resolve_draft(self, name: str) -> str:
        """A --draft value with `auto` replaced by this runtime's default drafter."""
        return resolve(name, self.default_draft)

    def resolve(self, spec: SpecConfig) -> SpecConfig:
        """`spec` with draft `auto` resolved (the tree shape kept; on a target whose trees are not exact, a chain
        of the same depth: engines.Engine.exact_trees)."""
        spec = replace(spec, draft=self.resolve_draft(spec.draft))
        if self.engine.exact_trees:
            return spec
        return replace(spec, tree_width=1, tree_budget=min(spec.tree_budget, spec.tree_depth))

    def draft_engine(self, name: str | DraftSpec):
        """The draft engine for a model drafter (`self-int8`, `early-exit:8`, ...), built once."""
        draft = parse_draft(name, self.cfg.n_layers)
        if ENGINE not in draft.kind.needs:
            raise UserError(f"--draft {draft} drafts without an engine of its own (model drafts have one: "
                            f"{', '.join(s for k in KINDS if ENGINE in k.needs for s in k.spellings())})")
        name = str(draft)
        with self._lock:
            if name not in self.draft_engines:
                self.draft_engines[name] = self.build_draft_engine(draft)
            return self.draft_engines[name]

    def verifier(self, head: ConfidenceHead | None = None) -> Verifier:
        """The early-layer verifier (its engine runs on the target engine's cache), scoring with `head`. Every
        verifier shares this runtime's one early-exit engine (it holds no sequence: each forward runs on the
        request's own cache), so the engine core scores all of a step's trees in one batched forward. One core thread
        steps a runtime's requests (Service's loop; `generate`'s core of one), never two at once."""
        return Verifier(self.draft_engine(DraftSpec(EARLY_EXIT, str(self.verifier_layers))), head)

    def has(self, need: str) -> bool:
        """Whether this runtime has what a drafter kind needs (draft_kinds.DATASTORE, HEAD; engines load lazily)."""
        if need == DATASTORE:
            return self.store is not None
        if need == HEAD:
            return self.head is not None and bool(self.engine.taps)
        return True

    def drafter(self, name: str | DraftSpec, sampling: SamplingConfig) -> Drafter:
        """A new drafter for one request (`name`: a --draft value, `auto` resolved here)."""
        draft = parse_draft(self.resolve_draft(str(name)), self.cfg.n_layers)
        for need in sorted(draft.kind.needs):
            if not self.has(need):
                raise UserError(f"--draft {draft} needs a build with {NEEDS_HELP[need]}, then pass --engines")
        return DRAFTERS[draft.kind](self, draft, sampling)

    def request(self, prompt_ids: list[int], cfg: GenerateConfig, mode: str = "plain",
                spec: SpecConfig = SpecConfig(), cache_scope: str = "", grammar: GrammarSpec | None = None,
                logprobs: int | None = None) -> Submission:
        """One request's submission for the engine core, with its own drafter and verifier (over the shared
        weights) and the tokenizer's decode; `cache_scope`: whose kept prefixes it may reuse (prefix_cache.py);
        `grammar`: what its output must match (spec/grammar.py: its own grammar state); `logprobs`: each token's
        log-probability and this many alternatives (spec/logprobs.py)."""
        assert mode in MODES, mode
        if grammar is not None and mode == "gate":
            raise UserError("a grammar needs lossless verification: gate mode accepts what the verifier alone "
                            "scores; use --mode spork or plain")
        if logprobs is not None and mode == "gate":
            raise UserError("logprobs need the target's rows at every token: gate mode accepts tokens the target "
                            "has not run; use --mode spork or plain")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP:
            raise UserError(f"logprobs: 0 to {MAX_TOP} alternatives per token, not {logprobs}")
        constraint = self.grammars.constraint(grammar) if grammar is not None else None
        spec = self.resolve(spec)
        head = self.heads.get(spec.draft)  # a head scores only the drafter it was fitted on
        check_verifier(mode, spec, cfg, head)
        drafter = self.drafter(spec.draft, cfg.sampling) if mode != "plain" else None
        scoring = mode == "gate" or (mode == "spork" and spec.verifier != "off" and head is not None)
        return Submission(prompt_ids, cfg, self.tokenizer.eos_ids, spec, drafter,
                          self.verifier(head) if scoring else None, self.tokenizer.decode, cache_scope=cache_scope,
                          constraint=constraint, logprobs=logprobs)

    def generate(self, prompt_ids: list[int], cfg: GenerateConfig, mode: str = "plain",
                 spec: SpecConfig = SpecConfig(), on_tokens: OnTokens | None = None,
                 stats: Stats | None = None, grammar: GrammarSpec | None = None,
                 logprobs: int | None = None) -> GenerationResult:
        """One request alone (the engine core with a batch of one); `stats`, when given, filled in place."""
        sub = self.request(prompt_ids, cfg, mode, spec, grammar=grammar, logprobs=logprobs)
        return run_alone(self.engine, sub, on_tokens, stats)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The grammar compiler for this tokenizer and vocabulary (built on the first constrained request)."""
        return Grammars(self.tokenizer.hf, self.cfg.vocab_size, self.tokenizer.eos_ids)


def build_target_device(dtype: str) -> str | None:
    """Where a build's target runs for a `--dtype`: its ONNX target (None) for fp32, else its checkpoint on the CPU's
    torch engine (bf16 and int4); auto: decided by Runtime.from_engines (resolve_target)."""
    return None if dtype in ("fp32", AUTO_DTYPE) else "cpu"


def torch_target(ck, device: str, dtype: str, taps: tuple[int, ...] = ()):
    """The target from checkpoint `ck` on a torch device: bf16 and int4 on the CPU run on the CPU torch engine
    (engines/cpu/engine.py: oneDNN's prepacked bf16 kernels; int4, the checkpoint's own 4-bit blocks), anything
    else on the device engine."""
    if device == "cpu" and dtype in CPU_TORCH_DTYPES:
        from spork_trt.engines.cpu.engine import cpu_target

        return cpu_target(ck, dtype, taps)
    if dtype not in DEVICE_DTYPES:
        raise UserError(f"--dtype {dtype} runs on the CPU (--device cpu): on {device} use one of "
                        f"{', '.join(DEVICE_DTYPES)}")
    from spork_trt.engines.device_engine import DeviceEngine

    return DeviceEngine(ck.model, device, dtype, taps)


def check_verifier(mode: str, spec: SpecConfig, cfg: GenerateConfig, head: ConfidenceHead | bool | None) -> None:
    """Gate mode and a forced verifier need a calibrated head (`head`: the head, or True when not known yet);
    gate mode is greedy only."""
    if mode == "gate" and not spec.gate_tau > 0:
        raise UserError("--mode gate needs --tau in (0, 1]: the path confidence above which the verifier alone "
                        "accepts")
    if mode == "gate" and parse_draft(spec.draft).kind.wants_hidden:
        raise UserError(f"--mode gate does not run with --draft {spec.draft} (the head needs the target's hidden "
                        "states of every committed token, which gate mode skips): use --mode spork")
    if mode == "gate" and not cfg.sampling.greedy:
        raise UserError("--mode gate is greedy only (it is measured against greedy decoding): drop --temperature")
    if (mode == "gate" or spec.verifier == "on") and not head:
        raise UserError(f"the verifier has no confidence head calibrated for the {spec.draft} drafter: run "
                        f"`python -m export calibrate --draft {spec.draft}` on the engines, pass them with --engines")


# what a build lacks, for a drafter kind's `needs` (draft_kinds)
NEEDS_HELP = {
    DATASTORE: "a datastore: `python -m export build` makes one (from the shipped corpus of the default model, or "
               "--store DATA)",
    HEAD: "a draft head: `python -m export build --head DIR` (a `python -m export train-draft` folder)",
}


def drafter_seed(sampling: SamplingConfig) -> int | None:
    """A drafter's own reproducible stream: the request's seed + 1."""
    return None if sampling.seed is None else sampling.seed + 1


def eagle_drafter(rt: Runtime, draft: DraftSpec, sampling: SamplingConfig) -> Drafter:
    head, embed, step = rt.head
    return EagleDrafter(head, embed, sampling, make_generator(drafter_seed(sampling)), step)


def store_eagle_drafter(rt: Runtime, draft: DraftSpec, sampling: SamplingConfig) -> Drafter:
    store, head = draft.kind.parts
    return StoreHeadDrafter(rt.drafter(store, sampling), rt.drafter(head, sampling), SpecConfig.for_draft(str(head)),
                            SpecConfig.store_min_match)


def hybrid_drafter(rt: Runtime, draft: DraftSpec, sampling: SamplingConfig) -> Drafter:
    _, model = draft.kind.parts  # the n-gram part matches longer suffixes than a lone n-gram drafter
    return HybridDrafter(NgramDrafter(SpecConfig.ngram_max, SpecConfig.hybrid_min_match), rt.drafter(model, sampling),
                         SpecConfig.for_draft(str(model)))


def model_drafter(rt: Runtime, draft: DraftSpec, sampling: SamplingConfig) -> Drafter:
    return ModelDrafter(rt.draft_engine(draft), sampling, make_generator(drafter_seed(sampling)),
                        share_prompt=draft.kind.shares_prompt)


# how each drafter kind is built, after Runtime.drafter checked its needs (AUTO is resolved before)
DRAFTERS: dict[DraftKind, Callable[[Runtime, DraftSpec, SamplingConfig], Drafter]] = {
    NGRAM: lambda rt, draft, sampling: NgramDrafter(SpecConfig.ngram_max),
    STORE: lambda rt, draft, sampling: StoreDrafter(NgramDrafter(SpecConfig.ngram_max), rt.store),
    EAGLE: eagle_drafter,
    STORE_EAGLE: store_eagle_drafter,
    HYBRID: hybrid_drafter,
    SELF: model_drafter,
    EARLY_EXIT: model_drafter,
    MODEL: model_drafter,
}


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, v_target: int, v_draft: int, where: str) -> None:
    if v_target != v_draft:
        raise UserError(f"draft model {where} has vocabulary size {v_draft}, the target {v_target}: "
                        "a draft model must share the target's tokenizer")
    if target.hf.get_vocab() != draft.hf.get_vocab() or target.eos_ids != draft.eos_ids:
        raise UserError(f"draft model {where} has a different tokenizer (vocabulary or special tokens) than the "
                        "target: a draft model must share the target's tokenizer")


def source_checkpoint(manifest: dict):
    """The checkpoint a build was made from, checked by sha256 (source_path)."""
    path = source_path(manifest)
    if path is None:
        raise UserError(f"the device engine runs the build's source checkpoint, {manifest['source']['path']}, which "
                        "is not here (copy it there, or build on this machine)")
    return load_checkpoint(path)


def resolve_target(manifest: dict, device: str | None, dtype: str) -> tuple[str | None, str]:
    """(device, dtype) for Runtime.from_engines: --dtype auto becomes default_target (device None: the build's
    ONNX target), any other dtype stays as asked."""
    if dtype != AUTO_DTYPE:
        return device, dtype
    if device is not None:
        return device, DEVICE_DTYPE
    t = default_target(manifest)
    return (t.device or None), t.flag
