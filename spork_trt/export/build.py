"""`python -m export build`: checkpoint -> engines/<name>/ (ONNX graphs, quantized drafts, tokenizer, manifest;
TensorRT plans of the target and verifier with --backend tensorrt).

Idempotent: an artifact whose recorded inputs (source checkpoint hash, build options, tool versions) and own hash
match the existing manifest is reused; --force rebuilds everything.

Atomic: a build is written into a temporary folder beside the output and replaces it whole at the end (atomic.folder),
so a build that fails or is killed at any point leaves the previous one as it was, and a loader never sees a mix
(manifest.read refuses a folder whose files do not match its manifest).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from spork_trt import atomic, io_spec
from spork_trt.checkpoint import manifest as mf
from spork_trt.config import VERIFIER_LAYERS
from spork_trt.spec.datastore import SUFFIXES, TOKENS
from spork_trt.spec.draft_head import EMBEDDINGS, HEAD_FILE, HEAD_GRAPH, load_head
from spork_trt.draft_kinds import EAGLE, EARLY_EXIT, NGRAM, QUANTS, SELF, SELF_DRAFTS, STORE, DraftSpec, is_kind, parse_draft
from spork_trt.errors import UserError
from spork_trt.checkpoint.weights import default_gguf_path, load_checkpoint
from spork_trt.export import tensorrt as trt_build
from spork_trt.export.artifacts import build_store, head_source, store_source, text_file
from spork_trt.export.gguf_blocks import BLOCKS_LAYOUT, int4_from_blocks
from spork_trt.export.onnx_graph import GRAPH_LAYOUT, OPSET, export_head_onnx, export_onnx
from spork_trt.export.quantize import quantize

PRECISIONS = ("fp32", *QUANTS)  # ONNX Runtime targets
CALIBRATED = {"int8-static", "fp8"}  # quantized from activation ranges measured on calibration prompts


@dataclass(frozen=True)
class BuildConfig:
    model: str | None = None  # None: the embedded default
    out: Path = Path("engines/default")
    precision: str = "fp32"  # the target's precision (onnx: PRECISIONS; tensorrt: tensorrt.PRECISIONS)
    drafts: tuple[str, ...] = ("self-int8", "self-int4")
    verifier_layers: int = VERIFIER_LAYERS
    backend: str = "onnx"
    force: bool = False
    store: str = "auto"  # the datastore's text: auto (shipped for this checkpoint) | none | a pack or self-data folder
    head: str = "auto"  # the learned draft head: auto (shipped for this checkpoint) | none | a train-draft folder
    attention: str = "gqa"  # io_spec.GQA | PLAIN (TensorRT builds always use PLAIN: a plan has no com.microsoft op)

    @property
    def graph_attention(self) -> str:
        return io_spec.PLAIN if self.backend == "tensorrt" else self.attention


def stage(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def check(cfg: BuildConfig) -> trt_build.TrtBuildConfig | None:
    """Refuse what this host or backend cannot build, before any work; the TensorRT plan settings."""
    for d in cfg.drafts:
        if not is_kind(d, SELF):
            raise UserError(f"--draft {d}: buildable drafts are {', '.join(SELF_DRAFTS)} (ngram needs no engine)")
    if cfg.attention not in io_spec.ATTENTIONS:
        raise UserError(f"--attention {cfg.attention}: use one of {', '.join(io_spec.ATTENTIONS)}")
    if cfg.backend == "onnx":
        if cfg.precision not in PRECISIONS:
            raise UserError(f"--precision {cfg.precision} is not buildable for ONNX Runtime: use "
                            f"{', '.join(PRECISIONS)} (fp16/bf16 with --backend tensorrt)")
        return None
    trt_cfg = trt_build.TrtBuildConfig(precision=cfg.precision)  # refuses precisions TensorRT has no path for
    trt_build.require_tensorrt()
    return trt_cfg


def calibration_signature() -> str:
    """sha256 of what static quantization calibrates on (the prompts, how many, the window): a change rebuilds."""
    from spork_trt.export.calib_data import CALIB_PROMPTS, CALIB_WINDOW, calibration_prompts

    return hashlib.sha256(json.dumps([CALIB_PROMPTS, CALIB_WINDOW, calibration_prompts()]).encode()).hexdigest()


def build(cfg: BuildConfig) -> Path:
    trt_cfg = check(cfg)
    out = cfg.out
    check_out(out, cfg.force)
    source = Path(cfg.model) if cfg.model else default_gguf_path()
    t0 = time.perf_counter()
    stage(f"hashing source checkpoint {source}")
    source_sha = mf.checkpoint_sha256(source)
    store_dir, store_what = store_source(cfg.store, source_sha)
    head_file, head_what = head_source(cfg.head, source_sha)
    if head_file is not None and cfg.backend != "onnx":
        if cfg.head != "auto":
            raise UserError("--head: the draft head runs with ONNX Runtime builds (--backend onnx) for now")
        head_file, head_what = None, "none (the draft head runs with ONNX Runtime builds)"
    quants = {parse_draft(d).arg for d in cfg.drafts}  # self-Q: the copies quantized to Q
    inputs = {"source_sha256": source_sha, "precision": cfg.precision, "verifier_layers": cfg.verifier_layers,
              "drafts": list(cfg.drafts), "opset": OPSET, "graph": GRAPH_LAYOUT,
              "attention": cfg.graph_attention, "tools": mf.tool_versions(),
              "backend": cfg.backend,
              "store": store_dir and {"from": store_what, "sha256": mf.sha256(text_file(store_dir))},
              "head": head_file and {"from": head_what, "sha256": mf.sha256(head_file)},
              "tensorrt": asdict(trt_cfg) | trt_tools() if trt_cfg else None,
              "calibration": calibration_signature() if CALIBRATED & {cfg.precision, *quants}
              else None,
              "int4_blocks": BLOCKS_LAYOUT if source.suffix.lower() == ".gguf" and cfg.backend == "onnx"
              and "int4" in {cfg.precision, *quants} else None}
    if not cfg.force and up_to_date(out, inputs):
        stage(f"up to date: {out} (use --force to rebuild)")
        render_triton(out)
        return out
    with atomic.folder(out) as work:  # the old build stays whole until the new one replaces it
        stage("loading checkpoint")
        ck = load_checkpoint(cfg.model)
        n_layers = ck.cfg.n_layers
        if not 1 <= cfg.verifier_layers < n_layers:
            raise UserError(f"--verifier-layers must be in 1..{n_layers - 1}, got {cfg.verifier_layers}")
        from spork_trt.checkpoint.tokenizer import load_tokenizer
        from spork_trt.export.calib_data import calibration_feeds

        tok = load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids)
        attention = cfg.graph_attention
        # static quantization's
        feeds = functools.cache(lambda: calibration_feeds(tok, ck.cfg, n_layers, attention))
        onnx_target = cfg.backend == "onnx" and cfg.precision != "fp32"
        engines: dict[str, dict] = {}
        head = check_head(head_file, ck, source_sha) if head_file is not None else None
        taps = head.hc.taps if head is not None else ()  # the target graph also outputs the head's features
        stage(f"exporting target.onnx (fp32, {attention} attention"
              + (f", hidden states after layers {list(taps)})" if taps else ")"))
        fp32 = export_onnx(ck.model, work / ("target_fp32.onnx" if onnx_target else "target.onnx"), taps=taps,
                           attention=attention)
        made: dict[str, Path] = {}  # quantization -> its graph: each is made once, whichever engines use it

        def quantized(q: str, path: Path) -> Path:
            if q not in made and q == "int4" and ck.kind == "gguf":
                stage(f"int4 from the checkpoint's own blocks: {path.name}")
                made[q] = int4_from_blocks(fp32, path, ck)
            if q not in made:
                stage(f"quantizing to {q}: {path.name}")
                made[q] = quantize(q, fp32, path, feeds)
            return made[q]

        if onnx_target:
            quantized(cfg.precision, work / "target.onnx")
        engines["target"] = {"path": "target.onnx", "backend": "onnx",
                             "precision": cfg.precision if cfg.backend == "onnx" else "fp32", "layers": n_layers,
                             "taps": list(taps)}
        if onnx_target and cfg.precision == "int4" and ck.kind == "gguf":
            engines["target"]["weights"] = "the checkpoint's own blocks (gguf_blocks.py)"
        stage(f"exporting verifier.onnx (first {cfg.verifier_layers} layers + final norm + LM head)")
        export_onnx(ck.model, work / "verifier.onnx", n_layers=cfg.verifier_layers, attention=attention)
        engines["verifier"] = {"path": "verifier.onnx", "backend": "onnx", "precision": "fp32",
                               "layers": cfg.verifier_layers}
        for draft in cfg.drafts:
            q = parse_draft(draft).arg  # self-Q: the target quantized to Q
            name = quantized(q, work / ("draft_" + q.replace("-", "_") + ".onnx")).name
            engines[draft] = {"path": name, "backend": "onnx", "precision": q, "layers": n_layers,
                              "taps": list(taps)}  # from fp32
        if trt_cfg is not None:
            engines |= build_plans(work, fp32, trt_cfg, ck.cfg, cfg.verifier_layers, quantized)
        if store_dir is not None:
            stage(f"indexing the datastore ({store_what})")
            store = build_store(store_dir, work)
            engines["store"] = {"path": TOKENS, "index": SUFFIXES, "precision": "int32", "layers": 0,
                                "tokens": int(len(store.tokens)), "from": store_what}
        else:
            stage(f"no datastore: {store_what} (--draft store needs one: --store DATA)")
        if head is not None:
            stage(f"adding the draft head ({head_what}) and the target's token embeddings it reads")
            shutil.copyfile(head_file, work / HEAD_FILE)
            np.save(work / EMBEDDINGS, ck.model.embed.weight.detach().numpy().astype(np.float16))  # [V, C]
            engines["head"] = {"path": HEAD_FILE, "embeddings": EMBEDDINGS, "precision": "fp16", "layers": 1,
                               "taps": list(taps), "vocab": head.hc.vocab, "from": head_what}
            stage(f"exporting {HEAD_GRAPH} (the draft head's step, layout {head.hc.layout})")  # ONNX Runtime, fp32
            export_head_onnx(head, work / HEAD_GRAPH)
            engines["head"]["graph"] = HEAD_GRAPH
        stage("writing tokenizer files")
        tok_files = [p.name for p in tok.save(work)]
        stage("hashing artifacts")
        artifacts = {}
        for p in sorted(work.iterdir()):
            if p.is_file() and p.name != mf.MANIFEST and not p.name.endswith((".tmp.onnx", ".tmp.plan")):
                artifacts[p.name] = {"sha256": mf.sha256(p), "bytes": p.stat().st_size}
        mf.write(work, {
            "format_version": mf.FORMAT_VERSION, "model": mf.model_spec(ck.cfg),
            "source": {"path": str(source), "kind": ck.kind, "sha256": source_sha},
            "backend": cfg.backend, "engines": engines, "verifier_layers": cfg.verifier_layers,
            "drafters": [NGRAM.name, *([STORE.name] if store_dir else []), *([EAGLE.name] if head else []),
                         *cfg.drafts, str(DraftSpec(EARLY_EXIT, str(cfg.verifier_layers)))],
            "tokenizer_files": tok_files, "artifacts": artifacts, "build_inputs": inputs,
            "tools": inputs["tools"] | (trt_tools() if trt_cfg else {}),
        })
        keep(out, work)
        render_triton(work)
    stage(f"done in {time.perf_counter() - t0:.0f}s: {out}")
    return out


def up_to_date(out: Path, inputs: dict) -> bool:
    """`out` holds a whole build made from these inputs, every artifact with its recorded sha256."""
    try:
        return mf.read(out).get("build_inputs") == inputs and bool(mf.read(out, verify=True))
    except UserError:  # no build there, or not a whole one: built anew
        return False


def previous_artifacts(folder: Path) -> set[str] | None:
    """The names a previous build in `folder` made (its manifest and the artifacts it lists), or None where the
    folder holds no readable manifest."""
    try:
        return {mf.MANIFEST, *json.loads((folder / mf.MANIFEST).read_text())["artifacts"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out the build cannot own: a file, or a non-empty folder that no build made (no readable manifest)
    unless --force; even then nothing in it is lost (keep carries it into the new build)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder: name a new or empty folder, or a previous build")
    if not out.is_dir() or previous_artifacts(out) is not None:
        return
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    if names and not force:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise UserError(f"--out {out} is not a build (no readable {mf.MANIFEST}) and holds {len(names)} entries "
                        f"({shown}): name a new or empty folder, or add --force to build into it (what is there is "
                        "kept)")


def keep(old: Path, new: Path) -> None:
    """Carry into the new build everything the folder it replaces holds besides the previous build's own files (its
    manifest and the artifacts it lists: the new build makes its own and drops those it no longer makes): the
    rendered triton_repo (re-rendered next), calibration heads and caches (`export calibrate`), server logs, dot-files,
    whatever else a user put there. Without a readable manifest every entry is the user's and is kept. Only the
    temporary names of killed writers (atomic.is_temp) are left behind. Hard links where possible: nothing is copied
    twice, and the old folder stays whole until it is replaced."""
    if not old.is_dir():
        return
    own = previous_artifacts(old) or set()
    for p in old.iterdir():
        if atomic.is_temp(p.name) or (new / p.name).exists() or p.name in own:
            continue  # a killed writer's leftover; a file this build made itself; the previous build's own
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True, copy_function=link_or_copy)
        elif p.is_symlink():
            os.symlink(os.readlink(p), new / p.name)
        else:
            link_or_copy(p, new / p.name)


def link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)


def check_head(path: Path, ck, source_sha: str):
    """The draft head at `path`, refused unless it was trained for this checkpoint's shapes (and, when its metadata
    names one, this very checkpoint)."""
    head, meta = load_head(path)
    hc, cfg = head.hc, ck.cfg
    if hc.dim != cfg.dim or hc.target_vocab != cfg.vocab_size or max(hc.taps) > cfg.n_layers:
        raise UserError(f"--head {path} was trained for a target of hidden size {hc.dim} and vocabulary "
                        f"{hc.target_vocab}, this checkpoint has {cfg.dim} and {cfg.vocab_size}: train one for it "
                        "with `python -m export train-draft`")
    if meta.get("target_sha256") not in (None, source_sha):
        raise UserError(f"--head {path} was trained on another checkpoint's features (sha256 "
                        f"{str(meta['target_sha256'])[:12]}, this one {source_sha[:12]}): train one for it with "
                        "`python -m export train-draft`")
    return head


def build_plans(out: Path, fp32: Path, trt_cfg: trt_build.TrtBuildConfig, model_cfg, verifier_layers: int,
                quantized) -> dict[str, dict]:
    """TensorRT plans of the target (int8-static/fp8 from their Q/DQ graphs, target_int8_static.onnx /
    target_fp8.onnx unless a draft made them; `quantized(q, path)` makes or reuses one) and the verifier (fp32,
    same profile: it runs on the target's KV cache). Drafts stay ONNX graphs on ONNX Runtime (MatMulNBits is not a
    TensorRT op)."""
    graph = fp32
    q = trt_cfg.precision
    if q in trt_build.QDQ_PRECISIONS:  # the Q/DQ graph a self-draft of the same kind already made, or a new one
        graph = quantized(q, out / f"target_{q.replace('-', '_')}.onnx")
    stage(f"building target.plan with TensorRT ({trt_cfg.precision}; minutes)")
    trt_build.build_plan(graph, out / "target.plan", trt_cfg, model_cfg, model_cfg.n_layers)
    stage("building verifier.plan with TensorRT (fp32)")
    v_cfg = replace(trt_cfg, precision="fp32", strongly_typed=False)
    trt_build.build_plan(out / "verifier.onnx", out / "verifier.plan", v_cfg, model_cfg, verifier_layers)
    ctx = model_cfg.max_seq_len
    return {"target": {"path": "target.plan", "backend": "tensorrt", "onnx": graph.name,
                       "layers": model_cfg.n_layers, **trt_cfg.record(ctx)},
            "verifier": {"path": "verifier.plan", "backend": "tensorrt", "onnx": "verifier.onnx",
                         "layers": verifier_layers, **v_cfg.record(ctx)}}


def trt_tools() -> dict:
    """A plan runs only on the TensorRT version and GPU it was built with: both are build inputs."""
    import tensorrt
    import torch

    return {"tensorrt": tensorrt.__version__, "gpu": torch.cuda.get_device_name()}


def render_triton(out: Path) -> None:
    from spork_trt.engines.default_target import default_target
    from spork_trt.serving.triton_repo import RepoConfig, render

    stage("rendering the Triton model repository triton_repo (cpu profile; the default target on this host: "
          f"{default_target(mf.read(out)).describe()})")
    render(RepoConfig(out))
