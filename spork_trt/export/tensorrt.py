"""TensorRT build path: runtime check. TensorRT engines need an NVIDIA GPU and the `tensorrt` package; neither
exists on the CPU machines this project is developed and tested on, so the build path stops here with one line
and exit code 2 (the README's support matrix marks TensorRT unverified)."""
from __future__ import annotations

import importlib.util
import shutil

from ..errors import UserError


def require_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        raise UserError("--backend tensorrt needs the `tensorrt` Python package and an NVIDIA GPU; neither is "
                        "installed here: use --backend onnx")
    if shutil.which("nvidia-smi") is None:
        raise UserError("--backend tensorrt needs an NVIDIA GPU (nvidia-smi not found): use --backend onnx")
    raise UserError("--backend tensorrt: engine building is not implemented yet in this version; use --backend onnx")
