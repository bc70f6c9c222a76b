"""`python -m bench roofline`: this machine's read bandwidth and fp32 matmul peak, and each build's target forward
against its bound, in one run.

    bound(T) = max(weight bytes / bandwidth, 2 x weight parameters x T / peak)

Weight bytes and parameters are those of the target graph's weight MatMuls (MatMul with a constant weight, or
MatMulNBits: its packed codes, scales and offsets), read once per forward; the embedding is a lookup (a few rows)
and not counted. Forwards run as the engine core runs them (`forward_batch`, the target's own `min_rows`): one
sequence of T new tokens after a committed context, and B sequences of one token each (a decode step of B
requests). The bandwidth is torch summing a 512 MB array, the peak torch's fp32 (and bf16) matmul at 2048^3, all
with this process's threads. `--torch bf16,fp32` adds the lever of bench/torch_lever.py (the reference model under
torch.compile, not an engine) at the same shapes, bounded by its dtype's bytes and peak; `--dtype bf16` the build's
checkpoint on the bf16 oneDNN engine (an engine: engines/cpu/engine.py), bounded by bf16 bytes and peak."""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spork_trt import atomic
from spork_trt.checkpoint import manifest as mf
from spork_trt.engines import chain_input, load_engine

from .costs import median_ms
from .prompts import git_sha

CONTEXT = 256  # committed rows before every timed forward


@dataclass(frozen=True)
class Machine:
    read_gbs: float  # GB/s
    matmul_gflops: float  # fp32, this process's threads
    bf16_gflops: float | None  # bf16 (oneDNN; AMX where the CPU has it); None where oneDNN has no bf16 kernels


@dataclass(frozen=True)
class Point:
    build: str
    precision: str
    shape: str  # "T=16" (one sequence) or "16x1" (16 sequences, one token each)
    ms: float
    bound_ms: float

    @property
    def ratio(self) -> float:
        return self.ms / self.bound_ms


def measure_machine(repeats: int = 5) -> Machine:
    import torch

    a = torch.ones(128 << 20)  # 512 MB, past every cache
    a.sum()
    t = min(timed(a.sum) for _ in range(repeats))  # torch's threads, as the engines read
    from spork_trt.engines.cpu.engine import onednn_bf16_available

    peaks = []
    for dtype in (torch.float32, torch.bfloat16)[:2 if onednn_bf16_available() else 1]:  # no oneDNN bf16: ATen's
        m = torch.randn(2048, 2048).to(dtype)  # slow loops, no peak to speak of (and no engine runs them)
        m @ m
        peaks.append(round(2 * 2048 ** 3 / min(timed(lambda: m @ m) for _ in range(repeats)) / 1e9, 1))
    return Machine(round(a.numel() * 4 / t / 1e9, 2), peaks[0], peaks[-1] if len(peaks) > 1 else None)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_cost(graph: Path) -> tuple[int, int]:
    """(bytes, parameters) of the graph's weight MatMuls."""
    import onnx

    g = onnx.load(str(graph), load_external_data=False).graph
    size = {i.name: (int(np.prod(i.dims)), i.data_type) for i in g.initializer}
    width = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.UINT8: 1, onnx.TensorProto.FLOAT16: 2}
    nbytes = params = 0
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in size:
            count, dtype = size[n.input[1]]
            nbytes, params = nbytes + count * width.get(dtype, 4), params + count
        elif n.op_type == "MatMulNBits":
            a = {x.name: x.i for x in n.attribute}
            params += a["K"] * a["N"]
            nbytes += sum(size[i][0] * width.get(size[i][1], 4) for i in n.input[1:] if i in size)
    return nbytes, params


def build_points(build: Path, machine: Machine, ts: list[int], batch: int, repeats: int) -> list[Point]:
    m = mf.read(build)
    entry, cfg = m["engines"]["target"], mf.spec_config(m["model"])
    label = entry["precision"] + (" (checkpoint blocks)" if entry.get("weights") else "")
    return engine_points(load_engine(build, entry, cfg, target=True), build, label,
                         weight_cost(build / entry["path"]), machine.matmul_gflops, machine, ts, batch, repeats)


def cpu_torch_points(build: Path, dtype: str, machine: Machine, ts: list[int], batch: int, repeats: int
                     ) -> list[Point]:
    """The build's checkpoint on the CPU torch engine in `dtype` (bf16 | int4: `--dtype` of generate, bench run and
    serve)."""
    from spork_trt.engines.cpu.linears import Int4Linear, PackedLinear, Q8Linear
    from spork_trt.engines.cpu.engine import built_on_one_thread, cpu_target
    from spork_trt.loop.runtime import source_checkpoint

    with built_on_one_thread():
        engine = cpu_target(source_checkpoint(mf.read(build)), dtype)
    linears = [m for m in engine.model.modules() if isinstance(m, (Int4Linear, PackedLinear, Q8Linear))]
    cost = sum(m.weight_bytes for m in linears), sum(m.weight_numel for m in linears)
    from spork_trt.engines.cpu.kernels import arithmetic

    fp32 = machine.bf16_gflops is None or (dtype == "int4" and arithmetic() == "avx2")  # its matmuls: fp32 fmas
    return engine_points(engine, build, f"{dtype} (CPU torch engine, {arithmetic()})" if dtype == "int4" else
                         f"{dtype} (CPU torch engine)", cost, machine.matmul_gflops if fp32 else machine.bf16_gflops,
                         machine, ts, batch, repeats)


def engine_points(engine, build: Path, label: str, cost: tuple[int, int], peak: float, machine: Machine,
                  ts: list[int], batch: int, repeats: int) -> list[Point]:
    """An engine's forwards as the engine core runs them, after CONTEXT committed rows; cost: (weight bytes,
    parameters); peak: GFLOP/s of its matmuls."""
    nbytes, params = cost
    pool = engine.make_pool(batch, CONTEXT + max(ts) + 4).caches
    for c in pool:
        engine.forward_batch([chain_input(c, [500 + i % 1000 for i in range(CONTEXT)], (CONTEXT - 1,))])
        c.commit()

    def bound(tokens: int) -> float:
        return 1000 * max(nbytes / (machine.read_gbs * 1e9), 2 * params * tokens / (peak * 1e9))

    def once(seqs: list[list[int]]):
        def run():
            engine.forward_batch([chain_input(c, s, (len(s) - 1,)) for c, s in zip(pool, seqs)])
            for c in pool[:len(seqs)]:
                c.commit([])
        return run

    points = [Point(str(build), label, f"T={t}", median_ms(once([list(range(7, 7 + t))]), repeats), bound(t))
              for t in ts]
    points.append(Point(str(build), label, f"{batch}x1", median_ms(once([[9]] * batch), repeats), bound(batch)))
    return points


def torch_points(build: Path, machine: Machine, ts: list[int], batch: int, repeats: int, dtype: str,
                 compiled: bool) -> list[Point]:
    """The torch lever's forwards at the same shapes (each shape compiled once, outside the timing)."""
    import torch

    from . import torch_lever

    model = torch_lever.reference_model(build, dtype)
    nbytes, params = torch_lever.weight_cost(model)
    peak = machine.bf16_gflops if dtype == "bf16" else machine.matmul_gflops
    label = f"torch {dtype}" + (" compiled" if compiled else " eager") + " (lever, not an engine)"
    points = []
    for b, t in [(1, t) for t in ts] + [(batch, 1)]:
        fn, args = torch_lever.forward_fn(model, compiled), torch_lever.shape_inputs(model, b, t, CONTEXT)
        with torch.no_grad():
            ms = median_ms(lambda: fn(*args), repeats)
        bound = 1000 * max(nbytes / (machine.read_gbs * 1e9), 2 * params * b * t / (peak * 1e9))
        points.append(Point(str(build), label, f"T={t}" if b == 1 else f"{b}x1", ms, bound))
    return points


def main(a) -> int:
    from .torch_lever import parse_dtypes

    dtypes = parse_dtypes(a.torch)
    machine = measure_machine()
    ts = [int(t) for t in a.tokens.split(",")]
    points = [p for b in a.builds for p in build_points(Path(b), machine, ts, a.batch, a.repeats)]
    checkpoints = {mf.read(Path(b))["source"]["sha256"]: Path(b) for b in reversed(a.builds)}  # once each
    if a.dtype != "fp32":
        points += [p for b in checkpoints.values()
                   for p in cpu_torch_points(b, a.dtype, machine, ts, a.batch, a.repeats)]
    points += [p for b in checkpoints.values() for d in dtypes
               for p in torch_points(b, machine, ts, a.batch, a.repeats, d, not a.torch_eager)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"git_sha": git_sha(), "machine": platform.machine(), **asdict(machine),
               "points": [asdict(p) | {"ratio": round(p.ratio, 2)} for p in points]}
    atomic.write_text(out / "roofline.json", json.dumps(summary, indent=1) + "\n")
    if a.json:
        print(json.dumps(summary))
        return 0
    print(f"this machine: read {machine.read_gbs} GB/s, matmul fp32 {machine.matmul_gflops} / bf16 "
          f"{machine.bf16_gflops or 'n/a (no oneDNN bf16 kernels)'} GFLOP/s")
    print("| build | target | forward | ms | bound ms | x bound |\n| --- | --- | --- | ---: | ---: | ---: |")
    for p in points:
        print(f"| {p.build} | {p.precision} | {p.shape} | {p.ms:.1f} | {p.bound_ms:.1f} | {p.ratio:.2f} |")
    return 0
