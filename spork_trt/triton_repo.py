"""Render a ready-to-serve Triton model repository from io_spec's tensor table and an engines folder.

Configs are built as Triton's own ModelConfig protobuf (tritonclient ships model_config_pb2) and written in its
text format, so a rendered config.pbtxt cannot drift from the schema; the model.py adapters are copied from the
top-level `triton_repo/` folder. Layout: OUT/{preprocessing,spork,postprocessing}/{config.pbtxt,1/model.py} and
OUT/ensemble/{config.pbtxt,1/}, plus the unary twins `spork_unary` and `ensemble_unary` (io_spec.ENTRY_POINTS).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import io_spec
from .config import SpecConfig
from .errors import UserError

PROFILES = ("cpu", "gpu")
MAX_BATCH_SIZE = 8  # requests the server may hand a model at once; each is still served on its own
TEMPLATES = Path(__file__).resolve().parents[1] / "triton_repo"
# the gpu profile runs the same loop on ONNX Runtime's TensorRT and CUDA execution providers (unverified: no GPU)
GPU_PROVIDERS = "TensorrtExecutionProvider,CUDAExecutionProvider,CPUExecutionProvider"


@dataclass(frozen=True)
class RepoConfig:
    engines: Path = Path("engines/default")
    out: Path | None = None  # None: ENGINES/triton_repo
    profile: str = "cpu"  # cpu | gpu
    instances: int = 1  # spork model instances
    max_concurrency: int = 8  # requests one spork instance runs at once (each on its own KV caches)
    draft: str = SpecConfig.draft
    # speculate while at most this many requests run on an instance (more: plain steps until fewer run); 0: always.
    # None: 1 on the cpu profile (one request's ONNX Runtime calls already take every core, so a second request
    # saturates them and a tree's extra compute lowers throughput), 0 on the gpu profile
    spec_max_active: int | None = None

    @property
    def repo(self) -> Path:
        return self.out or self.engines / "triton_repo"


def pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def tensor(t: io_spec.TritonTensor, io):
    m = pb()
    io.name, io.data_type, io.dims[:] = t.name, m.DataType.Value("TYPE_" + t.dtype), list(t.dims)
    if t.optional:
        io.optional = True


def model_config(name: str, inputs, outputs, **fields):
    """A ModelConfig with its tensors from io_spec."""
    c = pb().ModelConfig(name=name, max_batch_size=MAX_BATCH_SIZE, **fields)
    for t in inputs:
        tensor(t, c.input.add())
    for t in outputs:
        tensor(t, c.output.add())
    return c


def step_config(step: io_spec.TritonStep, name: str, decoupled: bool, params: dict[str, str], kind: str):
    m = pb()
    c = model_config(name, step.inputs, step.outputs, backend="python")
    if decoupled:
        c.model_transaction_policy.decoupled = True
    group = c.instance_group.add(kind=m.ModelInstanceGroup.Kind.Value(kind), count=int(params.pop("_count", 1)))
    if kind == "KIND_GPU":
        group.gpus.append(0)
    for k, v in params.items():
        c.parameters[k].string_value = v
    return c


def ensemble_config(name: str, spork: str):
    """An entry point: preprocessing -> `spork` (the decoupled step or its unary twin) -> postprocessing."""
    c = model_config(name, io_spec.ENSEMBLE_INPUTS, io_spec.ENSEMBLE_OUTPUTS, platform="ensemble")
    client = {t.name for t in io_spec.ENSEMBLE_INPUTS + io_spec.ENSEMBLE_OUTPUTS}
    for step in io_spec.TRITON_STEPS:
        s = c.ensemble_scheduling.step.add(model_name=spork if step.name == "spork" else step.name, model_version=-1)
        for t in step.inputs:  # tensors between steps get an internal name; client-facing ones keep theirs
            s.input_map[t.name] = t.name if t.name in client else "_" + t.name
        for t in step.outputs:
            s.output_map[t.name] = t.name if t.name in client else "_" + t.name
    return c


def is_rendered(repo: Path) -> bool:
    return (repo / "ensemble" / "config.pbtxt").is_file()


def ensure_rendered(cfg: RepoConfig) -> Path:
    """The repository, rendered first if it is absent (an existing one, maybe edited by hand, is kept)."""
    return cfg.repo if is_rendered(cfg.repo) else render(cfg)


def render(cfg: RepoConfig) -> Path:
    """Write the repository; returns its path. Idempotent: rewrites every file it owns."""
    from google.protobuf import text_format

    from .export import manifest as mf

    if cfg.profile not in PROFILES:
        raise UserError(f"--profile must be one of {', '.join(PROFILES)}, got {cfg.profile!r}")
    if not 1 <= cfg.instances <= 64 or not 1 <= cfg.max_concurrency <= 256:
        raise UserError("--instances must be in 1..64 and --max-concurrency in 1..256")
    if cfg.spec_max_active is not None and not 0 <= cfg.spec_max_active <= 256:
        raise UserError("--spec-max-active must be in 0..256 (0: speculate at any load)")
    mf.read(cfg.engines)  # a clear error if this is not a build
    if not TEMPLATES.is_dir():
        raise UserError(f"model templates not found at {TEMPLATES}: install spork_trt from its source tree "
                        "(pip install -e .)")
    repo = cfg.repo
    engines = cfg.engines.resolve()
    inside = repo.resolve().is_relative_to(engines)
    where = os.path.relpath(engines, repo.resolve()) if inside else str(engines)  # relative: the build can move
    gpu = cfg.profile == "gpu"
    params = {
        "preprocessing": {"engines": where},
        "spork": {"engines": where, "draft": cfg.draft, "max_concurrency": str(cfg.max_concurrency),
                  "spec_max_active": str((0 if gpu else 1) if cfg.spec_max_active is None else cfg.spec_max_active),
                  "providers": GPU_PROVIDERS if gpu else "CPUExecutionProvider", "_count": str(cfg.instances)},
        "postprocessing": {"engines": where},
    }
    configs = []  # (config, template folder or None)
    for s in io_spec.TRITON_STEPS:
        kind = "KIND_GPU" if gpu and s.name == "spork" else "KIND_CPU"
        names = io_spec.ENTRY_POINTS.values() if s.name == "spork" else (s.name,)
        configs += [(step_config(s, n, n == "spork", dict(params[s.name]), kind), s.name) for n in names]
    configs += [(ensemble_config(name, spork), None) for name, spork in io_spec.ENTRY_POINTS.items()]
    for c, template in configs:
        d = repo / c.name
        (d / "1").mkdir(parents=True, exist_ok=True)
        (d / "config.pbtxt").write_text(text_format.MessageToString(c))
        if template:
            shutil.copyfile(TEMPLATES / template / "model.py", d / "1" / "model.py")
    return repo
