"""engines/<name>/manifest.json: what was built, from what, with which tools, each engine's backend; the build
writes it, the runtime reads it and refuses a mismatch. It stands under both (config, errors and atomic
only)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from spork_trt import atomic
from spork_trt.config import Architecture, ModelConfig, RopeScaling
from spork_trt.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_sha256(path: Path) -> str:
    """A checkpoint's identity: the sha256 of a GGUF file, or of a Hugging Face directory's files (names and
    contents, sorted). Shipped artifacts and builds are keyed by it."""
    if path.is_file():
        return sha256(path)
    h = hashlib.sha256()
    for p in sorted(path.glob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(sha256(p).encode())
    return h.hexdigest()


def tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch

    from spork_trt import __version__

    return {"spork_trt": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__}


def model_spec(cfg: ModelConfig) -> dict:
    d = asdict(cfg)
    d["family"] = cfg.arch.family
    return d


def spec_config(d: dict) -> ModelConfig:
    d = {k: v for k, v in d.items() if k != "family"}
    if d.get("arch"):
        d["arch"] = Architecture(**{**d["arch"], "windowed": tuple(d["arch"].get("windowed", ()))})
    if d.get("rope_scaling"):
        rs = dict(d["rope_scaling"])
        rs["factors"] = tuple(rs.get("factors", ()))
        d["rope_scaling"] = RopeScaling(**rs)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def write(out: Path, manifest: dict) -> Path:
    return atomic.write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read(engines: Path, verify: bool = False) -> dict:
    """The manifest of the build in `engines`, refused (one line naming the fix) unless it is whole and matches
    its files: every artifact it lists is there with its recorded size (a stat each: always) and sha256 (reads every
    byte: when `verify`). Every loader of a build reads it here, so no half-written build is ever loaded."""
    path = engines / MANIFEST
    fix = f"rebuild with `python -m export build --out {engines} --force`"
    if not path.is_file():
        raise UserError(f"{engines} has no {MANIFEST} (not a build, or one that never finished): {fix}")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path} is torn (not valid JSON): {fix}") from None
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} has format_version {m.get('format_version') if isinstance(m, dict) else None}, "
                        f"this runtime reads {FORMAT_VERSION}: {fix}")
    for name, entry in m.get("artifacts", {}).items():
        p = engines / name
        if not p.is_file():
            raise UserError(f"{p} is missing ({MANIFEST} lists it): {fix}")
        if entry.get("bytes") not in (None, p.stat().st_size):  # manifests always recorded bytes; None: hand-made
            raise UserError(f"{p} has {p.stat().st_size} bytes, {MANIFEST} records {entry['bytes']}: {fix}")
        if verify and sha256(p) != entry["sha256"]:
            raise UserError(f"{p} does not match its sha256 in {MANIFEST}: {fix}")
    return m


def engine_backend(entry: dict) -> str:
    """The backend that runs one engine of a build (engines.LOADERS' key): the entry's `backend`. Builds made before
    entries recorded it ran every graph on ONNX Runtime but the plans of `--backend tensorrt`, the entries with a
    TensorRT profile."""
    return entry.get("backend") or ("tensorrt" if "profile" in entry else "onnx")


def weights(m: dict, entry: dict) -> dict:
    """The artifact record ({"sha256", "bytes"}) holding an engine's weights: its external data file when the graph
    has one (ONNX), else the file itself (a TensorRT plan)."""
    return m["artifacts"].get(entry["path"] + ".data", m["artifacts"].get(entry["path"], {}))


def describe_target(m: dict) -> str:
    """One line on what a build serves, e.g. "int4 target (the checkpoint's own blocks), 30 layers"."""
    t = m["engines"]["target"]
    return (f"{t['precision']} target" + (f" ({t['weights'].split(' (')[0]})" if t.get("weights") else "")
            + f", {t['layers']} layers")
