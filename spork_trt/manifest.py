"""engines/<name>/manifest.json: what was built, from what, with which tools, each engine's backend; the build
writes it, the runtime reads it and refuses a mismatch. It stands under both (config and errors only)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from .config import ModelConfig, RopeScaling
from .errors import UserError

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

    from . import __version__

    return {"spork_trt": __version__, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__}


def model_spec(cfg: ModelConfig) -> dict:
    d = asdict(cfg)
    d["family"] = "llama"
    return d


def spec_config(d: dict) -> ModelConfig:
    d = {k: v for k, v in d.items() if k != "family"}
    if d.get("rope_scaling"):
        rs = dict(d["rope_scaling"])
        rs["factors"] = tuple(rs.get("factors", ()))
        d["rope_scaling"] = RopeScaling(**rs)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def write(out: Path, manifest: dict) -> Path:
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read(engines: Path) -> dict:
    path = engines / MANIFEST
    if not path.is_file():
        raise UserError(f"{engines} has no {MANIFEST}: build engines first with `python -m export build --out "
                        f"{engines}`")
    m = json.loads(path.read_text())
    if m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} has format_version {m.get('format_version')}, this runtime reads "
                        f"{FORMAT_VERSION}: rebuild with `python -m export build --out {engines} --force`")
    return m


def verify_artifacts(engines: Path, manifest: dict) -> None:
    """Check every artifact's sha256 against the manifest (slow for big files: used by `inspect --verify`)."""
    for name, entry in manifest["artifacts"].items():
        p = engines / name
        if not p.is_file() or sha256(p) != entry["sha256"]:
            raise UserError(f"{p} is missing or does not match its manifest hash: rebuild with --force")


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
