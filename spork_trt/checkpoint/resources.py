"""What a checkpoint needs before it is loaded: the loader expands every weight to fp32 in RAM (the reference model,
the build's export), so a model whose fp32 weights alone exceed the memory this machine has free is refused in one
line before a byte of weight is read, instead of being killed for memory minutes later."""
from __future__ import annotations

from pathlib import Path

from spork_trt.errors import UserError

FP32_BYTES = 4
GIB = 2**30


def available_bytes() -> int:
    """RAM this machine can give a new allocation now (psutil: free plus reclaimable caches)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(path: Path, n_params: int) -> None:
    """Refuse `path` when its `n_params` weights in fp32 exceed the available RAM (a lower bound of what loading
    needs: the file's own buffers and activations come on top)."""
    need, have = n_params * FP32_BYTES, available_bytes()
    if need > have:
        raise UserError(f"{path}: its {n_params / 1e9:.2f}B parameters take {need / GIB:.1f} GiB as fp32 weights, "
                        f"but this machine has {have / GIB:.1f} GiB of RAM available: free memory, use a machine "
                        "with more, or a smaller model")
