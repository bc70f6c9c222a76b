"""TensorRT build path: an ONNX graph (io_spec's names, weights in external data alongside) -> a serialized plan with
one optimisation profile derived from io_spec's symbolic dims.

TensorRT needs an NVIDIA GPU and the `tensorrt` package (10 or newer); the CPU machines this project is developed and
tested on have neither, so `require_tensorrt()` (engines/trt_engine.py: the runtime's check, which the build asks too) stops there with one
line (exit code 2). What does not touch TensorRT (`TrtBuildConfig.limits`, `profile_shapes`, `qdq_nodes`) is tested on
CPU.

TensorRT 10 -> 11, as handled here (NVIDIA's 10.x-to-11.x migration guide and the Python bindings of both):
- networks are explicit batch since 10.0: EXPLICIT_BATCH is ignored in 10 and removed in 11, so it is never passed;
- STRONGLY_TYPED is opt-in in 10; in 11 every network is strongly typed and the flag is kept but ignored;
- the weak-typing BuilderFlags FP16/BF16/INT8/FP8 are deprecated in 10.12 and removed in 11: fp16/bf16 from an fp32
  graph needs TensorRT 10 (on 11 the graph must carry its own types), and int8-static/fp8 are always built from a
  graph with Q/DQ nodes as a strongly typed network (explicit quantization: no calibrator, no flags).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spork_trt import atomic, io_spec
from spork_trt.config import ModelConfig
from spork_trt.engines.trt_engine import require_tensorrt
from spork_trt.errors import UserError

PRECISIONS = ("fp32", "fp16", "bf16", "int8-static", "fp8")
QDQ_PRECISIONS = ("int8-static", "fp8")  # built from the Q/DQ graphs export/quantize.py makes (the same names)
WEAK_FLAGS = {"fp16": "FP16", "bf16": "BF16"}  # BuilderFlag names; TensorRT 10 only

Shape = tuple[int, ...]
Limits = dict[str, tuple[int, int, int]]  # symbolic dim -> (min, opt, max)


@dataclass(frozen=True)
class TrtBuildConfig:
    precision: str = "fp32"
    max_batch: int = 1  # the runtime runs batch 1 per sequence
    max_new_tokens: int = 256  # most new tokens per forward; the engine runs longer prompts in chunks
    opt_new_tokens: int = 8  # a verify step's tree: the size TensorRT tunes its kernels for
    max_seq_len: int | None = None  # the context window served; None: the model's
    spare_positions: int = 64  # past the window: generate's cache also holds a step's draft tree beyond it
    opt_seq_len: int = 512
    workspace_gb: float = 8.0
    strongly_typed: bool = False  # the graph carries its own types (always so for int8/fp8, and on TensorRT 11)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision {self.precision} is not buildable for TensorRT: use {', '.join(PRECISIONS)}")
        if min(self.max_batch, self.max_new_tokens, self.opt_new_tokens, self.opt_seq_len) < 1 or (
                self.spare_positions < 0 or self.max_seq_len is not None and self.max_seq_len < 1):
            raise UserError(f"TensorRT profile sizes must be positive: {self}")

    @property
    def typed(self) -> bool:
        return self.strongly_typed or self.precision in QDQ_PRECISIONS

    def limits(self, context: int) -> Limits:
        """(min, opt, max) per io_spec symbolic dim; `context` (the model's window) when max_seq_len is None.
        opt TOTAL = opt PAST + opt NEW, so the opt shapes describe one consistent forward."""
        s_max = (self.max_seq_len or context) + self.spare_positions
        t_max = min(self.max_new_tokens, s_max)
        t_opt = min(self.opt_new_tokens, t_max)
        s_opt = min(max(self.opt_seq_len, t_opt), s_max)
        return {io_spec.BATCH: (1, 1, self.max_batch), io_spec.NEW: (1, t_opt, t_max),
                io_spec.PAST: (0, s_opt - t_opt, s_max - 1), io_spec.TOTAL: (1, s_opt, s_max),
                io_spec.ROWS: (1, t_opt, self.max_batch * t_max)}

    def record(self, context: int) -> dict:
        """What a manifest keeps about a plan built with this config."""
        return {"precision": self.precision, "strongly_typed": self.typed,
                "profile": {dim: list(v) for dim, v in self.limits(context).items()}}


def profile_shapes(specs: list[io_spec.TensorSpec], limits: Limits) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape per input: symbolic dims from `limits`, fixed dims as they are."""
    for s in specs:
        unknown = {d for d in s.dims if isinstance(d, str)} - limits.keys()
        assert not unknown, (s.name, unknown)
    return {s.name: tuple(tuple(limits[d][i] if isinstance(d, str) else d for d in s.dims) for i in range(3))
            for s in specs}


def qdq_nodes(onnx_path: Path) -> int:
    """How many QuantizeLinear/DequantizeLinear nodes the graph has (its external weights are not read)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)


def build_plan(onnx_path: Path, plan_path: Path, cfg: TrtBuildConfig, model_cfg: ModelConfig, n_layers: int) -> Path:
    """Parse `onnx_path` (a graph of `n_layers` layers, io_spec's I/O) and write its serialized plan to `plan_path`."""
    trt = require_tensorrt()
    typed = strongly_typed(trt, cfg, onnx_path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path.resolve())):  # the file's directory holds its external data
        errors = " | ".join(str(parser.get_error(i)).replace("\n", " ") for i in range(parser.num_errors))
        raise UserError(f"TensorRT {trt.__version__} could not parse {onnx_path}: {errors or 'no parser message'}")
    shapes = profile_shapes(io_spec.inputs(model_cfg, n_layers), cfg.limits(model_cfg.max_seq_len))
    got = [network.get_input(i).name for i in range(network.num_inputs)]
    if got != list(shapes):
        raise UserError(f"{onnx_path} inputs {got} are not io_spec's for {n_layers} layers: re-export the graph")
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config = builder.create_builder_config()
    config.add_optimization_profile(profile)
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gb * (1 << 30)))
    set_precision(trt, config, cfg.precision, typed)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError(f"TensorRT {trt.__version__} could not build {onnx_path} ({cfg.precision}); its log above "
                        "says why")
    atomic.write_bytes(plan_path, plan)  # IHostMemory is a buffer
    return plan_path


def strongly_typed(trt, cfg: TrtBuildConfig, onnx_path: Path) -> bool:
    """Whether to build a strongly typed network; refuses what this TensorRT cannot build from this graph."""
    if cfg.precision in QDQ_PRECISIONS and qdq_nodes(onnx_path) == 0:
        raise UserError(f"--precision {cfg.precision} builds from a graph with Q/DQ nodes (explicit quantization; "
                        f"TensorRT has no implicit {cfg.precision} path) and {onnx_path} has none: quantize it to "
                        "QuantizeLinear/DequantizeLinear first")
    flag = WEAK_FLAGS.get(cfg.precision)
    if not cfg.typed and flag and not hasattr(trt.BuilderFlag, flag):
        raise UserError(f"--precision {cfg.precision}: TensorRT {trt.__version__} builds only strongly typed "
                        f"networks, so an fp32 graph stays fp32: convert the graph to {cfg.precision} first "
                        "(ModelOpt AutoCast) and build it strongly typed, or use TensorRT 10")
    return cfg.typed


def network_flags(trt, typed: bool) -> int:
    # EXPLICIT_BATCH is never passed (ignored since 10.0, gone in 11); STRONGLY_TYPED is kept, and ignored, in 11
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if typed and flag is not None else 0


def set_precision(trt, config, precision: str, typed: bool) -> None:
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: TF32 matmuls (on by default) round the inputs
    elif not typed:
        config.set_flag(getattr(trt.BuilderFlag, WEAK_FLAGS[precision]))  # TensorRT 10 weak typing (checked above)
