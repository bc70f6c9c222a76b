"""TensorRT engine: same interface as the torch and ONNX Runtime engines, over a plan built by export/tensorrt.py.
`require_tensorrt` is what a host needs to run one (and so to build one: the build asks the same).

The KV cache lives on the GPU in preallocated torch buffers [L, 1, Smax, Hkv, D] (a kv_cache.Rows, as for ONNX
Runtime). Each forward binds every layer's past rows in place (a contiguous prefix of the layer's buffer) and points
the new-row outputs straight after them, by address, so the bytes moved per step do not depend on the context length.
TensorRT wants 256-byte aligned tensor addresses: every layer's buffer starts aligned, and when `past` rows do not
end on an aligned address (rows shorter than 256 bytes) the new rows land in an aligned staging buffer and are copied
after the past rows (T rows per layer: still independent of the context length).
"""
from __future__ import annotations

import importlib.util
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from spork_trt import io_spec
from spork_trt.config import ModelConfig
from spork_trt.errors import UserError
from spork_trt.engines.kv_cache import KVPool, Rows
from spork_trt.engines import Engine, SeqInput

MIN_MAJOR = 10  # name-based tensor API, INT64 I/O, no implicit batch
REBUILD = "python -m export build --backend tensorrt --force"
ALIGN = 256  # bytes: IExecutionContext::setTensorAddress wants at least this alignment (TensorRT 10 and 11 headers)
TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT8": torch.int8,
                "UINT8": torch.uint8, "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool}


def require_tensorrt():
    """The `tensorrt` module, or a UserError saying what this host lacks."""
    if importlib.util.find_spec("tensorrt") is None:
        raise UserError("--backend tensorrt needs the `tensorrt` Python package (10 or newer) and an NVIDIA GPU; "
                        "tensorrt is not installed here: pip install tensorrt on a GPU host, or use --backend onnx")
    if not has_cuda_device():
        raise UserError("--backend tensorrt needs an NVIDIA GPU and none is visible here (torch.cuda and nvidia-smi "
                        "find none): use --backend onnx")
    import tensorrt as trt

    if trt_major(trt) < MIN_MAJOR:
        raise UserError(f"--backend tensorrt needs TensorRT {MIN_MAJOR} or newer, found {trt.__version__}: "
                        "pip install -U tensorrt")
    return trt


def has_cuda_device() -> bool:
    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


def trt_major(trt) -> int:
    return int(trt.__version__.split(".")[0])


def align_rows(row_bytes: int) -> int:
    """The fewest rows whose bytes are a multiple of ALIGN: offsets in steps of it keep an aligned buffer aligned."""
    return ALIGN // math.gcd(row_bytes, ALIGN)


@dataclass(frozen=True)
class TrtPlan:
    """A deserialized plan, shared by every engine over it (each engine has its own execution context)."""

    runtime: object  # trt.Runtime: kept alive as long as the engine it deserialized
    engine: object  # trt.ICudaEngine
    dtypes: dict[str, torch.dtype]  # I/O tensor name -> buffer dtype, as the plan declares them
    max_new: int  # most new tokens per forward: the profile's max NEW
    max_total: int  # most past + new positions: the profile's max TOTAL
    device: torch.device  # the CUDA device the plan was deserialized on

    @classmethod
    def load(cls, path: Path, cfg: ModelConfig, n_layers: int) -> TrtPlan:
        trt = require_tensorrt()
        if not torch.cuda.is_available():
            raise UserError("the TensorRT engine keeps its buffers in torch CUDA tensors and this torch build sees "
                            "no CUDA device: install a CUDA build of torch on the GPU host, or use --backend onnx")
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
        if engine is None:
            raise UserError(f"TensorRT {trt.__version__} could not load {path} (a plan runs only on the TensorRT "
                            f"version and GPU it was built with): rebuild it with `{REBUILD}`")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        want = {s.name: trt.TensorIOMode.INPUT for s in io_spec.inputs(cfg, n_layers)}
        want |= {s.name: trt.TensorIOMode.OUTPUT for s in io_spec.outputs(cfg, n_layers)}
        if {n: engine.get_tensor_mode(n) for n in names} != want:
            raise UserError(f"{path} does not have io_spec's inputs and outputs for a {n_layers}-layer model: "
                            f"rebuild it with `{REBUILD}`")
        dtypes = {n: TORCH_DTYPES[engine.get_tensor_dtype(n).name] for n in names}
        _, _, hi = engine.get_tensor_profile_shape("attention_mask", 0)  # [B, T, S]: min, opt, max
        return cls(runtime, engine, dtypes, max_new=hi[1], max_total=hi[2],
                   device=torch.device("cuda", torch.cuda.current_device()))


class TrtEngine(Engine):
    padded_batches = False  # a batch runs sequence by sequence: it costs the sum of its sequences
    def __init__(self, path: Path, cfg: ModelConfig, n_layers: int | None = None, plan: TrtPlan | None = None) -> None:
        self._cfg = cfg
        self.n_layers = cfg.n_layers if n_layers is None else n_layers
        self.plan = plan or TrtPlan.load(path, cfg, self.n_layers)
        self.names = io_spec.kv_names(self.n_layers)
        self.context = self.plan.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.plan.device)
        self.scratch: dict[str, torch.Tensor] = {}  # flat device buffers kept between forwards, grown on demand

    @property
    def cfg(self) -> ModelConfig:
        return self._cfg

    def make_cache(self, max_len: int) -> Rows:
        if max_len > self.plan.max_total:
            raise UserError(f"{max_len} positions asked (prompt, new tokens and a draft tree), the TensorRT plan "
                            f"holds at most {self.plan.max_total}: lower --max-new-tokens or the tree budget, or "
                            "rebuild the plan with more spare_positions")
        dtype = self.plan.dtypes[self.names[0][0]]
        hkv, d = self._cfg.n_kv_heads, self._cfg.head_dim
        step = align_rows(hkv * d * dtype.itemsize)
        shape = (self.n_layers, 1, -(-max_len // step) * step, hkv, d)  # Smax rounded up: every layer starts aligned
        return Rows(torch.zeros(shape, dtype=dtype, device=self.plan.device),
                    torch.zeros(shape, dtype=dtype, device=self.plan.device), axis=2)

    def make_pool(self, slots: int, max_len: int) -> KVPool:
        """One buffer pair per slot, all allocated now (binding addresses by arithmetic wants each slot's layers at
        a fixed stride); unverified, no GPU here."""
        return KVPool([self.make_cache(max_len) for _ in range(slots)])

    def forward_batch(self, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor]:
        """A ragged batch, one execution per sequence on its own cache (the plan's profile is batch 1: its KV inputs
        are each sequence's rows bound in place by address), all on this engine's stream. Logits [r_b, V] each."""
        self.check_hidden(hidden)  # plans are built without the draft head's hidden-state output
        return [self.forward(s.cache, torch.tensor([s.tokens]), torch.tensor([s.positions]), s.mask(), s.rows)[0]
                for s in seqs]

    def forward(self, c: Rows, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None, hidden: list | None = None) -> torch.Tensor:
        """input_ids, position_ids [1, T] over cache `c` (k, v: [L, 1, Smax, Hkv, D] CUDA buffers); mask [1, T,
        length + pending + T] -> logits [1, R, V] at `rows` (None: all T; CPU, float32). More new tokens than the
        plan takes (a long prompt) run as consecutive chunks: exact, since no mask row attends to a later new
        position (causal and tree masks put parents before children)."""
        self.check_hidden(hidden)  # plans are built without the draft head's hidden-state output
        t = input_ids.shape[1]
        assert input_ids.shape[0] == 1, "the TensorRT engine runs batch 1 per sequence"
        past = c.length + c.pending
        assert mask.shape[-1] == past + t, (mask.shape, past)
        room = min(c.max_len, self.plan.max_total)
        if past + t > room:
            raise ValueError(f"KV cache full: {past + t} positions needed, {room} allocated")
        want = list(range(t)) if rows is None else list(rows)
        chunks = []
        for a in range(0, t, self.plan.max_new):
            b = min(a + self.plan.max_new, t)
            assert not mask[:, a:b, past + b:].any(), "a new token attends to a later one"
            chunks.append(self._run(c, input_ids[:, a:b], position_ids[:, a:b], mask[:, a:b, :past + b],
                                    [r - a for r in want if a <= r < b]))
        return torch.cat(chunks, dim=0)[None]  # [1, R, V]

    def _run(self, c: Rows, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
             rows: list[int]) -> torch.Tensor:
        """One execution over cache `c`: input_ids, position_ids [1, T]; mask [1, T, S] with T <= max_new -> logits
        [R, V] at `rows` (R = len(rows); row 0 stands in for none, its logits dropped)."""
        dt = self.plan.dtypes
        t, s = mask.shape[1], mask.shape[2]
        past = s - t
        assert past == c.length + c.pending, (past, c.length, c.pending)
        # the cache may be another plan's (the verifier runs on the target's): same KV dtype and device needed
        assert c.k.dtype == dt[self.names[0][0]] and c.k.device == self.plan.device, (c.k.dtype, c.k.device)
        hkv, d, v = self._cfg.n_kv_heads, self._cfg.head_dim, self._cfg.vocab_size
        row = hkv * d * c.k.element_size()  # bytes per KV row
        step = align_rows(row)
        direct = past % step == 0  # the new rows' address, right after the past rows, is aligned
        tpad = -(-self.plan.max_new // step) * step  # staging rows per layer: every layer's slice starts aligned
        self.stream.wait_stream(torch.cuda.current_stream(self.plan.device))  # commit() gathers on that stream
        with torch.cuda.stream(self.stream):
            at = torch.tensor(rows or [0], dtype=torch.long)  # [R]
            for name, x in (("input_ids", input_ids), ("position_ids", position_ids), ("attention_mask", mask),
                            ("logit_rows", at)):
                buf = self._buffer(name, x.numel(), dt[name]).view(x.shape)
                buf.copy_(x)
                self._bind(name, buf.data_ptr(), tuple(x.shape))
            stage = [None if direct else self._buffer(f"stage_{kv}", self.n_layers * tpad * hkv * d, c.k.dtype)
                     .view(self.n_layers, tpad, hkv, d) for kv in "kv"]  # [L, Tpad, Hkv, D]
            # addresses by arithmetic, not views: an empty view (past = 0) reports data_ptr() 0 and TensorRT wants
            # every input address non-null
            for layer, (pk, pv, nk, nv) in enumerate(self.names):
                for buf, st, pname, nname in ((c.k, stage[0], pk, nk), (c.v, stage[1], pv, nv)):
                    first = buf.data_ptr() + layer * c.max_len * row  # row 0 of this layer: [Smax, Hkv, D]
                    self._bind(pname, first, (1, past, hkv, d))
                    self._bind(nname, first + past * row if direct else st.data_ptr() + layer * tpad * row)
            logits = self._buffer("logits", len(at) * v, dt["logits"]).view(len(at), v)
            self._bind("logits", logits.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (its log says why)")
            if not direct:
                c.k[:self.n_layers, 0, past:past + t] = stage[0][:, :t]  # the cache may have more layers
                c.v[:self.n_layers, 0, past:past + t] = stage[1][:, :t]
            out = logits[:len(rows)].float().cpu()
        self.stream.synchronize()
        c.written(t)
        return out

    def _buffer(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n elements of a flat device buffer kept between forwards (a fresh allocation starts aligned)."""
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self.scratch[name] = torch.empty(max(n, 1), dtype=dtype, device=self.plan.device)
        return buf[:n]

    def _bind(self, name: str, address: int, input_shape: tuple[int, ...] | None = None) -> None:
        """Point a tensor at `address`; an input also gets its shape for this execution."""
        assert address and address % ALIGN == 0, (name, address)
        if input_shape is not None and not self.context.set_input_shape(name, input_shape):
            raise RuntimeError(f"TensorRT refused shape {input_shape} for {name} (outside the plan's profile)")
        self.context.set_tensor_address(name, address)
