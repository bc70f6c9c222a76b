"""`python -m export build`: checkpoint -> engines/<name>/ (ONNX graphs, quantized drafts, tokenizer, manifest).

Idempotent: an artifact whose recorded inputs (source checkpoint hash, build options, tool versions) and own hash
match the existing manifest is reused; --force rebuilds everything.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import VERIFIER_LAYERS
from ..errors import UserError
from ..weights import default_gguf_path, load_checkpoint
from . import manifest as mf
from .onnx_graph import OPSET, export_onnx
from .quantize import quantize_nbits

PRECISIONS = ("fp32", "int8", "int4")


@dataclass(frozen=True)
class BuildConfig:
    model: str | None = None  # None: the embedded default
    out: Path = Path("engines/default")
    precision: str = "fp32"  # the target's precision
    drafts: tuple[str, ...] = ("self-int8", "self-int4")
    verifier_layers: int = VERIFIER_LAYERS
    backend: str = "onnx"
    force: bool = False


def stage(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


def build(cfg: BuildConfig) -> Path:
    if cfg.backend == "tensorrt":
        from .tensorrt import require_tensorrt

        require_tensorrt()
    if cfg.precision not in PRECISIONS:
        raise UserError(f"--precision {cfg.precision} is not buildable for ONNX Runtime CPU: "
                        f"use {', '.join(PRECISIONS)}")
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    source = Path(cfg.model) if cfg.model else default_gguf_path()
    t0 = time.perf_counter()
    stage(f"hashing source checkpoint {source}")
    source_sha = mf.sha256(source) if source.is_file() else dir_sha(source)
    inputs = {"source_sha256": source_sha, "precision": cfg.precision, "verifier_layers": cfg.verifier_layers,
              "drafts": list(cfg.drafts), "opset": OPSET, "tools": mf.tool_versions()}
    old = json.loads((out / mf.MANIFEST).read_text()) if (out / mf.MANIFEST).is_file() else None
    if old and not cfg.force and old.get("build_inputs") == inputs and all(
            (out / n).is_file() and mf.sha256(out / n) == e["sha256"] for n, e in old["artifacts"].items()):
        stage(f"up to date: {out} (use --force to rebuild)")
        render_triton(out)
        return out
    stage("loading checkpoint")
    ck = load_checkpoint(cfg.model)
    n_layers = ck.cfg.n_layers
    if not 1 <= cfg.verifier_layers < n_layers:
        raise UserError(f"--verifier-layers must be in 1..{n_layers - 1}, got {cfg.verifier_layers}")
    engines: dict[str, dict] = {}
    stage("exporting target.onnx (fp32)")
    fp32 = export_onnx(ck.model, out / ("target.onnx" if cfg.precision == "fp32" else "target_fp32.onnx"))
    if cfg.precision != "fp32":
        stage(f"quantizing target to {cfg.precision}")
        quantize_nbits(fp32, out / "target.onnx", bits=8 if cfg.precision == "int8" else 4)
    engines["target"] = {"path": "target.onnx", "precision": cfg.precision, "layers": n_layers}
    stage(f"exporting verifier.onnx (first {cfg.verifier_layers} layers + final norm + LM head)")
    export_onnx(ck.model, out / "verifier.onnx", n_layers=cfg.verifier_layers)
    engines["verifier"] = {"path": "verifier.onnx", "precision": "fp32", "layers": cfg.verifier_layers}
    for draft in cfg.drafts:
        bits = {"self-int8": 8, "self-int4": 4}.get(draft)
        if bits is None:
            raise UserError(f"--draft {draft}: buildable drafts are self-int8 and self-int4 (ngram needs no engine)")
        stage(f"quantizing {draft} draft (MatMulNBits, {bits} bits, blocks of 32)")
        name = f"draft_int{bits}.onnx"
        quantize_nbits(fp32, out / name, bits=bits)
        engines[draft] = {"path": name, "precision": f"int{bits}", "layers": n_layers}
    stage("writing tokenizer files")
    from ..tokenizer import load_tokenizer

    tok_files = [p.name for p in load_tokenizer(ck.path, ck.kind, ck.cfg.eos_token_ids).save(out)]
    stage("hashing artifacts")
    artifacts = {}
    for p in sorted(out.iterdir()):
        if p.is_file() and p.name != mf.MANIFEST and not p.name.endswith(".tmp.onnx"):
            artifacts[p.name] = {"sha256": mf.sha256(p), "bytes": p.stat().st_size}
    mf.write(out, {
        "format_version": mf.FORMAT_VERSION, "model": mf.model_spec(ck.cfg),
        "source": {"path": str(source), "kind": ck.kind, "sha256": source_sha},
        "backend": cfg.backend, "engines": engines, "verifier_layers": cfg.verifier_layers,
        "drafters": ["ngram", *cfg.drafts, f"early-exit:{cfg.verifier_layers}"], "tokenizer_files": tok_files,
        "artifacts": artifacts, "build_inputs": inputs, "tools": inputs["tools"],
    })
    render_triton(out)
    stage(f"done in {time.perf_counter() - t0:.0f}s: {out}")
    return out


def render_triton(out: Path) -> None:
    from ..triton_repo import RepoConfig, render

    stage(f"rendering the Triton model repository {render(RepoConfig(out))} (cpu profile)")


def dir_sha(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.glob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(mf.sha256(p).encode())
    return h.hexdigest()
