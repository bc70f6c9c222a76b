"""Render a ready-to-serve Triton model repository from io_spec's tensor table and an engines folder.

Configs are built as Triton's own ModelConfig protobuf (tritonclient ships model_config_pb2) and written in its
text format, so a rendered config.pbtxt cannot drift from the schema; the model.py adapters are copied from
`spork_trt/serving/triton_models/` (package data: a pip install renders repositories too). Layout: OUT/<python model>/{config.pbtxt,1/model.py} for the steps
`preprocessing`, `spork`, `postprocessing` and the unary models `spork_unary` and `ensemble_unary`
(io_spec.PYTHON_MODELS), and OUT/ensemble/{config.pbtxt,1/} (the streaming entry point).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from spork_trt import atomic, io_spec
from spork_trt.config import AUTO_DTYPE as AUTO, DEVICE_DTYPE, DEVICE_DTYPES, TARGET_DTYPES, SpecConfig
from spork_trt.draft_kinds import AUTO_DRAFT
from spork_trt.errors import UserError

PROFILES = ("cpu", "gpu", "gpu-onnx")
MAX_BATCH_SIZE = 8  # requests the server may hand a model at once; each is still answered on its own
TEMPLATES = Path(__file__).resolve().with_name("triton_models")  # the python models' sources (package data)
# gpu: the spork model's target on the device engine (engines/device_engine.py: CUDA graphs, KV pool on the GPU);
# gpu-onnx: the build's ONNX graphs on ONNX Runtime's TensorRT and CUDA execution providers (both unverified: no GPU)
DEVICES = ("", "cpu", "cuda")  # "": the build's ONNX Runtime engines; cpu runs the device engine's code eagerly
GPU_PROVIDERS = "TensorrtExecutionProvider,CUDAExecutionProvider,CPUExecutionProvider"


@dataclass(frozen=True)
class RepoConfig:
    engines: Path = Path("engines/default")
    out: Path | None = None  # None: ENGINES/triton_repo
    profile: str = "cpu"  # cpu | gpu | gpu-onnx
    instances: int = 1  # spork model instances (each one engine core over its own KV pool)
    slots: int = 16  # requests one instance decodes at once (KV pool slots); more queue
    draft: str = AUTO_DRAFT  # resolved by the server: store when the engines have a datastore, else ngram
    max_context: int = 0  # positions a request may use (prompt + max_tokens); 0: the model's context window
    max_queue: int = 64  # requests waiting for a slot per instance; beyond them: UNAVAILABLE, retry later
    unary_instances: int = 4  # light instances of each unary model (BLS callers of spork), each a batch at once
    device: str | None = None  # the target on the device engine there (DEVICES); None: cuda for gpu, else ""
    dtype: str = AUTO  # the torch engine's precision (TARGET_DTYPES); auto: deployed_target
    prefix_reuse: bool = True  # a prompt starting with a finished request's KV rows reuses them (prefix_cache)
    request_timeout_s: float = 600.0  # a request's deadline: the default, and the longest `timeout_s` it may ask

    @property
    def repo(self) -> Path:
        return self.out or self.engines / "triton_repo"

    @property
    def target_device(self) -> str:
        return ("cuda" if self.profile == "gpu" else "") if self.device is None else self.device


def tree_room(draft: str) -> int:
    """KV positions past the context a slot keeps for one step's tree (admission.size_request, Service.context)."""
    return SpecConfig.for_draft(draft).tree_room


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


def ensemble_config():
    """The streaming entry point: preprocessing -> spork (decoupled) -> postprocessing."""
    c = model_config(io_spec.ENSEMBLE, io_spec.ENSEMBLE_INPUTS, io_spec.ENSEMBLE_OUTPUTS, platform="ensemble")
    client = {t.name for t in io_spec.ENSEMBLE_INPUTS + io_spec.ENSEMBLE_OUTPUTS}
    given = {t.name for t in io_spec.ENSEMBLE_INPUTS}  # what a step's inputs can be: these and earlier steps' outputs
    used = client | {t.name for step in io_spec.TRITON_STEPS for t in step.inputs}  # an output nobody reads: unmapped
    for step in io_spec.TRITON_STEPS:
        s = c.ensemble_scheduling.step.add(model_name=step.name, model_version=-1)
        for t in step.inputs:  # between steps an internal name; client-facing ones keep theirs
            if t.name in given:
                s.input_map[t.name] = t.name if t.name in client else "_" + t.name
            else:  # only another model sends it (cancel_key: the unary models')
                assert t.optional, t
        for t in step.outputs:
            if t.name not in used:  # spork's logprobs: its own stream's (io_spec.LOGPROB_OUTPUTS)
                continue
            s.output_map[t.name] = t.name if t.name in client else "_" + t.name
            given.add(t.name)
    return c


def bound_queue(c, size: int) -> None:
    """Triton's queue in front of `c` holds at most `size` requests; beyond them a request is refused at once
    (UNAVAILABLE) instead of waiting unbounded. A queue policy needs the dynamic batcher: it hands an instance what
    waits, no delay (the unary models answer a batch's requests concurrently)."""
    c.dynamic_batching.max_queue_delay_microseconds = 0
    c.dynamic_batching.default_queue_policy.max_queue_size = size


@dataclass(frozen=True)
class SporkModel:
    """What a rendered repository's `spork` model config says (read back, for the launcher, k8s and the API)."""
    instances: int
    params: dict[str, str]  # its parameters: engines, draft, slots, max_len, ...
    engines: Path  # the build it serves (the `engines` parameter; relative: to the repository)


def spork_model(repo: Path) -> SporkModel:
    from google.protobuf import text_format

    path = repo / "spork" / "config.pbtxt"
    if not path.is_file():
        raise UserError(f"{path} is missing: render the repository first with `python -m export triton`")
    c = text_format.Parse(path.read_text(), pb().ModelConfig())
    params = {k: v.string_value for k, v in c.parameters.items()}
    where = Path(params["engines"])
    return SporkModel(sum(g.count for g in c.instance_group) or 1, params,
                      where if where.is_absolute() else (repo / where).resolve())


def engines_of(repo: Path) -> Path:
    """The build a rendered repository serves."""
    return spork_model(repo).engines


def is_rendered(repo: Path) -> bool:
    return (repo / "ensemble" / "config.pbtxt").is_file()


def adapters_current(repo: Path) -> bool:
    """Every model.py adapter in the repository is the one this version of spork_trt ships (an older render's
    adapters do not fit the library they would import)."""
    return all((repo / name / "1" / "model.py").is_file()
               and (repo / name / "1" / "model.py").read_bytes() == (TEMPLATES / name / "model.py").read_bytes()
               for name in io_spec.PYTHON_MODELS)


def ensure_rendered(cfg: RepoConfig, verify: bool = False) -> Path:
    """The repository, rendered first if it is absent or its adapters are from another version of spork_trt (an
    existing current one, maybe edited by hand, is kept); refused if the build is not whole (manifest.read: sizes,
    sha256 too when `verify`)."""
    from spork_trt.checkpoint import manifest as mf

    mf.read(cfg.engines, verify)
    if is_rendered(cfg.repo) and adapters_current(cfg.repo):
        return cfg.repo
    if is_rendered(cfg.repo):
        print(f"{cfg.repo} was rendered by another version of spork_trt: rendering it again", file=sys.stderr)
    return render(cfg)


def deployed_target(cfg: RepoConfig, manifest: dict) -> tuple[str, str]:
    """(device, dtype) the spork model runs: --dtype auto with no --device on the cpu profile is the build's
    default target on this host (engines/default_target.py: the int4 CPU engine where it is the fastest, else the
    build's ONNX target); auto with a device is that device engine's DEVICE_DTYPE."""
    if cfg.dtype != AUTO:
        return cfg.target_device, cfg.dtype
    if cfg.device is None and cfg.profile == "cpu":
        from spork_trt.engines.default_target import default_target

        t = default_target(manifest)
        return t.device, t.flag
    return cfg.target_device, DEVICE_DTYPE


def render(cfg: RepoConfig) -> Path:
    """Write the repository; returns its path. Idempotent: rewrites every file it owns."""
    from google.protobuf import text_format

    from spork_trt.checkpoint import manifest as mf

    if cfg.profile not in PROFILES:
        raise UserError(f"--profile must be one of {', '.join(PROFILES)}, got {cfg.profile!r}")
    if not 1 <= cfg.instances <= 64 or not 1 <= cfg.slots <= 256 or not 1 <= cfg.unary_instances <= 64:
        raise UserError("--instances must be in 1..64, --slots in 1..256 and --unary-instances in 1..64")
    if cfg.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0 (0: refuse requests while every slot is in use), got "
                        f"{cfg.max_queue}")
    if not 0 < cfg.request_timeout_s < float("inf"):
        raise UserError(f"--request-timeout must be a positive number of seconds, got {cfg.request_timeout_s}")
    if cfg.target_device not in DEVICES or cfg.dtype not in (AUTO, *TARGET_DTYPES):
        raise UserError(f"--device must be one of cuda, cpu (or none: ONNX Runtime) and --dtype one of "
                        f"{', '.join((AUTO, *TARGET_DTYPES))}, got {cfg.target_device!r} and {cfg.dtype!r}")
    if cfg.dtype not in (AUTO, *DEVICE_DTYPES) and cfg.target_device != "cpu":
        raise UserError(f"--dtype {cfg.dtype} runs on the CPU torch engine: pass --device cpu")
    manifest = mf.read(cfg.engines)  # a clear error if this is not a build
    device, dtype = deployed_target(cfg, manifest)
    window = mf.spec_config(manifest["model"]).max_seq_len
    if cfg.profile == "gpu-onnx" and manifest.get("build_inputs", {}).get("attention") == io_spec.GQA:
        print(f"warning: {cfg.engines} has GroupQueryAttention graphs, whose attention ONNX Runtime's GPU providers "
              "run on the CPU (its CUDA kernels are fp16/bf16 only): for --profile gpu-onnx build with "
              "`python -m export build --attention plain`", file=sys.stderr)
    if not 0 <= cfg.max_context <= window:
        raise UserError(f"--max-context must be in 1..{window} (the model's context window; 0 means all of it)")
    max_len = (cfg.max_context or window) + tree_room(cfg.draft)
    if not TEMPLATES.is_dir():
        raise UserError(f"model templates not found at {TEMPLATES}: install spork_trt from its source tree "
                        "(pip install -e .)")
    repo = cfg.repo
    engines = cfg.engines.resolve()
    inside = repo.resolve().is_relative_to(engines)
    where = os.path.relpath(engines, repo.resolve()) if inside else str(engines)  # relative: the build can move
    gpu = cfg.profile != "cpu"
    params = {
        "preprocessing": {"engines": where},
        "spork": {"engines": where, "draft": cfg.draft, "slots": str(cfg.slots), "max_len": str(max_len),
                  "max_queue": str(cfg.max_queue), "prefix_reuse": str(int(cfg.prefix_reuse)),
                  "timeout_s": str(cfg.request_timeout_s),
                  "providers": GPU_PROVIDERS if cfg.profile == "gpu-onnx" else "CPUExecutionProvider",
                  "device": device, "dtype": dtype, "_count": str(cfg.instances)},
        "spork_unary": {"_count": str(cfg.unary_instances)},
        "ensemble_unary": {"_count": str(cfg.unary_instances)},
        "postprocessing": {"engines": where},
    }
    configs = [(step_config(io_spec.model_step(n), n, n == "spork", dict(params[n]),
                            "KIND_GPU" if gpu and n == "spork" else "KIND_CPU"), n)
               for n in io_spec.PYTHON_MODELS]  # (config, template folder or None)
    configs.append((ensemble_config(), None))
    for c, _ in configs:
        if c.name in io_spec.UNARY_MODELS:
            bound_queue(c, max(cfg.max_queue, 1))
    for c, template in configs:
        d = repo / c.name
        (d / "1").mkdir(parents=True, exist_ok=True)
        atomic.write_text(d / "config.pbtxt", text_format.MessageToString(c))
        if template:
            atomic.copy_file(TEMPLATES / template / "model.py", d / "1" / "model.py")
    return repo
