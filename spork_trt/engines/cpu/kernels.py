"""spork::int4_mm, the CPU torch engine's own block matmul (avx512_matmul.cpp): a checkpoint's blocks (Q4_0 / Q4_1 /
Q4_K as 4-bit codes, Q5_0 / Q5_1 / Q5_K / Q8_0 as 8-bit codes; fp16 scales, fp32 for the K-quants) against bf16
activations with AVX512-BF16 dot products, or AMX-BF16's tile unit where the CPU has it (for every row
count: a process runs one or the other, `arithmetic()` says which), every row by the same instructions (row-invariant
by construction), each block's codes expanded once for all rows (for a few rows, into registers as they are used).
Built with torch's C++ extension loader the first time a process asks (about 20 s on 2 cores, then cached under
~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); `make setup` builds it; `--prebuild` (main below) builds every
flavor without loading one, for an image (Dockerfile), and a stamped folder is then loaded without compiling. The
same library holds spork::attend (avx512_attention.cpp), which the engine's layers use wherever it is built, with its
small ops in avx512_ops.cpp (cpu_forward.fused_layers), and all of a forward's layers on the int4 kernels as one op
(fused_layers.cpp: spork::int4_layers).

On a CPU without AVX512-BF16 but with AVX2, FMA and F16C the same ops build from avx2_matmul.cpp and avx2_ops.cpp
(the `avx2` flavor: the same packed layouts, the matmuls on x in 16 bits per block of 32 and integer
dot products, the attention in fp32 fmas, its own bits). Where neither can run (no C++ compiler, an
older CPU, or SPORK_INT4_KERNEL=aten) the engine keeps ATen's int4 CPU
kernel (`_weight_int4pack_mm_for_cpu`), also row-invariant but other arithmetic: its tokens can differ from this
kernel's, so a deployment's plain and spork decoding both run whichever this machine has (`kernel()` says which).
"""
from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).with_name("avx512_matmul.cpp")


@dataclass(frozen=True)
class Flavor:
    """One build of spork's CPU ops: the same op schemas and packed layouts, each with its own arithmetic."""
    name: str  # also the arithmetic its calls run where it has no AMX: arithmetic()
    sources: tuple[Path, ...]  # one library
    headers: tuple[Path, ...]  # what the sources include (torch's loader hashes sources only)
    flags: tuple[str, ...]


def _here(*names: str) -> tuple[Path, ...]:
    return tuple(Path(__file__).with_name(n) for n in names)


FLAVORS = {
    # AVX512-BF16 (EPYC from Zen 4, Xeons from Cooper Lake), AMX's tiles where the CPU has them
    "avx512-bf16": Flavor("avx512-bf16", _here("avx512_matmul.cpp", "avx512_attention.cpp", "avx512_ops.cpp",
                                               "fused_layers.cpp"), _here("avx512_simd.h", "spork_ops.h", "op_checks.h"),
                          ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-mfma",
                           "-mamx-tile", "-mamx-bf16", "-fopenmp")),  # at::parallel_for on torch's OpenMP threads
    # AVX2 + FMA + F16C without AVX512-BF16 (EPYC before Zen 4, Xeons before Cooper Lake, most desktops): 16-bit
    # integer dot products (vpmaddwd), fp32 fmas
    "avx2": Flavor("avx2", _here("avx2_matmul.cpp", "avx2_ops.cpp", "fused_layers.cpp"),
                   _here("avx2_simd.h", "spork_ops.h", "op_checks.h"),
                   ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")),
}
TILE = 16  # columns per tile of the packed layout
CHUNK = 64  # columns a thread computes at once: avx512_matmul.cpp NT tiles


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def flavor() -> Flavor | None:
    """The build this CPU runs: AVX512-BF16's where it has it, else AVX2's where it has AVX2, FMA and F16C, else none
    (ATen's kernels). SPORK_KERNELS=avx2 asks for AVX2's on any CPU that has it (to test it beside the other)."""
    have = cpu_flags()
    if os.environ.get("SPORK_KERNELS") != "avx2" and "avx512_bf16" in have:
        return FLAVORS["avx512-bf16"]
    if {"avx2", "fma", "f16c"} <= have:
        return FLAVORS["avx2"]
    return None


@functools.cache
def kernel() -> str:
    """'spork' when spork::int4_mm is built and loaded in this process, else 'aten' (why, once, as a warning), with
    the op's schema defined so that TorchScript still compiles engines/cpu/forward.py (it never calls it then)."""
    built = build()
    if not built:
        lib = torch.library.Library("spork", "DEF")
        for name, schema in SCHEMAS.items():
            lib.define(schema)
            lib.impl(name, unavailable, "CPU")
        PLACEHOLDER.append(lib)  # a Library's definitions last while it does
    return "spork" if built else "aten"


def arithmetic() -> str:
    """The dot products this process's int4 matmuls and attention (its scores and P @ V) run: 'amx' (AMX-BF16's
    tiles; SPORK_AMX=0 turns them off), 'avx512-bf16' (vdpbf16ps, and fp32 fmas for P @ V), 'avx2' (16-bit
    integer dot products in avx2_matmul.cpp, fp32 fmas in the attention) or 'aten' (ATen's kernel). Their bits
    differ, so plain and spork decoding in one deployment both run the same one."""
    if kernel() != "spork":
        return "aten"
    return "amx" if torch.ops.spork.uses_amx() else flavor().name


# as the sources define them
SCHEMAS = {"int4_mm": "int4_mm(Tensor x, Tensor packed, Tensor scales, bool wide=False) -> Tensor",
           "q8_mm": "q8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor",
           "attend": "attend(Tensor qk, int heads, Tensor pool_k, Tensor pool_v, Tensor slots, Tensor mask) -> Tensor",
           "rms_norm": "rms_norm(Tensor x, Tensor w, float eps) -> Tensor",
           "add_rms_norm": "add_rms_norm(Tensor x, Tensor d, Tensor w, float eps) -> (Tensor, Tensor)",
           "rope_store": "rope_store(Tensor qkv, Tensor cos, Tensor sin, int heads, Tensor(a!) pool_k, "
                         "Tensor(b!) pool_v, Tensor slots, Tensor write) -> Tensor",
           "silu_mul": "silu_mul(Tensor gu) -> Tensor",
           "int4_layers": "int4_layers(Tensor x, Tensor real, int b, int t, Tensor cos, Tensor sin, Tensor mask, "
                          "Tensor(a!) pool_k, Tensor(b!) pool_v, Tensor slots, Tensor write, Tensor[] norms, "
                          "Tensor[] packed, Tensor[] scales, int heads, float eps, int[] taps) -> (Tensor, Tensor[])"}
PLACEHOLDER: list = []


def unavailable(*args):
    raise RuntimeError("spork's CPU kernels are not built in this process (int4_kernel.kernel() is 'aten')")


def build() -> bool:
    fl = flavor()
    if os.environ.get("SPORK_INT4_KERNEL", "spork") == "aten" or fl is None:
        return False
    try:
        d = build_directory(fl)
        if (d / BUILT).is_file():  # built before (an image's prebuilt kernels): loaded without compiler or ninja
            torch.ops.load_library(str(d / f"{library(fl)}.so"))
            return True
        from torch.utils import cpp_extension

        on_path_ninja()
        cpp_extension.load(name=library(fl), sources=[str(p) for p in fl.sources], extra_cflags=list(fl.flags),
                           extra_ldflags=["-fopenmp"], build_directory=str(d), is_python_module=False, verbose=False)
        (d / BUILT).touch()
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: ATen's kernel still runs
        warnings.warn(f"spork::int4_mm is unavailable ({type(e).__name__}: {e}); int4 runs ATen's kernel",
                      RuntimeWarning)
        return False
    return True


BUILT = "built"  # a build folder's stamp: its library linked completely (the folder's key names its sources' bytes)


def library(fl: Flavor) -> str:
    return f"spork_{fl.name.replace('-', '_')}"


def on_path_ninja() -> None:
    """The build tool torch's extension loader runs, on PATH also when the venv is not activated."""
    import ninja

    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def prebuild(fl: Flavor) -> Path:
    """Compile one flavor's library without loading it (any x86-64 host with g++ can: its flags name the ISA, never
    -march=native), stamped so that a process on a CPU of that flavor loads it without building: the image's build
    stage (Dockerfile) makes both. Torch's loader's own build step, called directly (it has no build-only entry)."""
    from torch.utils import cpp_extension

    on_path_ninja()
    d = build_directory(fl)
    cpp_extension._write_ninja_file_and_build_library(
        name=library(fl), sources=[str(p) for p in fl.sources], extra_cflags=list(fl.flags), extra_cuda_cflags=None,
        extra_sycl_cflags=None, extra_ldflags=["-fopenmp"], extra_include_paths=None, build_directory=str(d),
        verbose=False, with_cuda=False, with_sycl=False)
    (d / BUILT).touch()
    return d / f"{library(fl)}.so"


def build_directory(fl: Flavor | None = None) -> Path:
    """Where the kernel is built and cached: one folder per source file, torch version and flags (two checkouts
    sharing one rebuilt it for each other, replacing the library another process was loading), with a lock left by
    a build that was killed (older than STALE_LOCK_S) removed: torch's loader waits for the lock to go, forever."""
    fl = fl or flavor() or FLAVORS["avx512-bf16"]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in fl.headers + fl.sources)).hexdigest()  # every byte
    sources = "|".join(str(p.resolve()) for p in fl.sources)
    key = hashlib.sha256(f"{sources}|{headers}|{torch.__version__}|{' '.join(fl.flags)}".encode()).hexdigest()[:12]
    d = root / f"spork_int4-{key}"
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            warnings.warn(f"removed a stale build lock {lock} (a build was killed)", RuntimeWarning)
            lock.unlink()
    except FileNotFoundError:
        pass
    return d


STALE_LOCK_S = 600  # a build takes ~10 s on 2 cores


def pack(codes: np.ndarray, d: np.ndarray, off: np.ndarray, bits: int = 4,
         fp16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (4 bits: 0..15; 8 bits: 0..255, e.g. Q8_0's q + 128 or Q5's 0..31), d and off [N, K/32]
    (w = d c + off: Q8_0's off = -128 d, Q5_0's -16 d; the checkpoint's fp16 values, or with `fp16` False the
    K-quants' fp32 ones) -> packed [N, K * bits / 8] uint8 and scales [N, K/16] fp16 (fp32), both in
    avx512_matmul.cpp's order: chunks of CHUNK columns, block by block."""
    n, k = codes.shape
    if n % TILE or k % 32:
        raise ValueError(f"spork's block kernels need N a multiple of {TILE} and K of 32, not [{n}, {k}]")
    g = k // 32
    if bits == 4:
        quads = codes.astype(np.uint8).reshape(n // TILE, TILE, g, 8, 2, 2)  # [tile, j, g, e, s, h]: k = 32g + 4e + 2s + h
        tiles = (quads[..., 0, :] | (quads[..., 1, :] << 4)).transpose(2, 0, 3, 1, 4)  # [g, tile, e, j, h]
    else:
        pairs = codes.astype(np.uint8).reshape(n // TILE, TILE, g, 16, 2)  # [tile, j, g, p, h]: k = 32g + 2p + h
        tiles = pairs.transpose(2, 0, 3, 1, 4)  # [g, tile, p, j, h]
    kind = np.float16 if fp16 else np.float32
    scales = np.stack([d.T, off.T], axis=1).astype(kind).reshape(g, 2, n // TILE, TILE)  # [g, d|off, tile, j]
    if not (np.array_equal(scales[:, 0].reshape(g, n).astype(np.float32), d.T)
            and np.array_equal(scales[:, 1].reshape(g, n).astype(np.float32), off.T)):
        raise ValueError(f"the blocks' scales are not {'fp16' if fp16 else 'fp32'} values: spork's kernel would not "
                         "compute their weights")
    per = CHUNK // TILE
    chunks = range(0, n // TILE, per)
    packed = np.concatenate([tiles[:, c:c + per].ravel() for c in chunks])  # each chunk [g, its tiles, e|p, j, h]
    sc = np.concatenate([scales[:, :, c:c + per].ravel() for c in chunks])  # each chunk [g, d|off, its tiles, j]
    return torch.from_numpy(packed.reshape(n, k * bits // 8)), torch.from_numpy(sc.reshape(n, k // 16))


def main(argv: list[str] | None = None) -> int:
    """`python -m spork_trt.engines.cpu.kernels --prebuild`: every flavor's library, for an image whose CPUs are not
    known when it is built (TORCH_EXTENSIONS_DIR: where)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m spork_trt.engines.cpu.kernels", description=main.__doc__)
    p.add_argument("--prebuild", action="store_true", help="compile every flavor (%s)" % ", ".join(FLAVORS))
    a = p.parse_args(argv)
    if a.prebuild:
        for fl in FLAVORS.values():
            print(f"{fl.name}: {prebuild(fl)}", flush=True)
    print(f"this CPU runs: {flavor().name if flavor() else 'aten (no flavor)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
