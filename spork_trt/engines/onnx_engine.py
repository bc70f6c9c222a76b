"""ONNX Runtime engine: same interface as the torch engine, KV cache in preallocated numpy buffers bound with IO
binding, in the graph's attention layout (io_spec):
- GQA (the default CPU graph): caches [L, 1, Hkv, Smax, D]; one sequence binds each layer's whole buffer as both
  past and present and the GroupQueryAttention op appends the new rows in place; a batch (its tokens packed)
  binds a BNSH Staging the same way and copies each sequence's new rows to its cache after the forward.
- PLAIN: caches [L, 1, Smax, Hkv, D]; one sequence binds its past rows in place (a contiguous prefix of each
  layer's buffer) and ONNX Runtime writes the new rows straight after them.
Either way the bytes moved per step do not depend on the context length."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from spork_trt import io_spec
from spork_trt.config import ModelConfig
from spork_trt.errors import UserError
from spork_trt.engines.kv_cache import KVPool, Rows
from spork_trt.engines import Engine, Padded, SeqInput
from spork_trt.engines.row_invariance import forward_padded, pad_to_rows
from spork_trt.engines.staging import Staging


def session_options(threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or os.cpu_count() or 1
    so.inter_op_num_threads = 1
    # target and draft sessions take turns on the same cores: a pool that spin-waits after its run would steal
    # the cores the other session needs next
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def provider_options(providers: tuple[str, ...], model: Path) -> list[dict[str, str]]:
    """Per provider options: ONNX Runtime's TensorRT provider caches the engines and tactic timings it builds beside
    the model (minutes per build, seconds to reload); CPU and CUDA need none (on CPU the session, graph
    optimizations included, is created in about 1 s for the default target: no optimized-model cache is kept)."""
    cache = str(model.resolve().parent / "ort_trt_cache")
    trt = {"trt_engine_cache_enable": "True", "trt_engine_cache_path": cache, "trt_timing_cache_enable": "True",
           "trt_timing_cache_path": cache}
    return [trt if p == "TensorrtExecutionProvider" else {} for p in providers]


SEQUENCE = -1  # kv_bindings key of the one-sequence path (stagings are keyed by their id)


class OnnxEngine(Engine):
    def __init__(self, path: Path, cfg: ModelConfig, n_layers: int | None = None, max_new: int = 64,
                 session=None, providers: tuple[str, ...] = ("CPUExecutionProvider",),
                 taps: tuple[int, ...] = (), min_rows: int = 1) -> None:
        import onnxruntime as ort

        self._cfg = cfg
        self.n_layers = cfg.n_layers if n_layers is None else n_layers
        if session is None:
            missing = set(providers) - set(ort.get_available_providers())
            if missing:
                raise UserError(f"ONNX Runtime here lacks {', '.join(sorted(missing))} (available: "
                                f"{', '.join(ort.get_available_providers())}): install onnxruntime-gpu on a GPU host "
                                "or use the cpu profile")
        self.session = session or ort.InferenceSession(str(path), session_options(), providers=list(providers),
                                                       provider_options=provider_options(providers, path))
        self.attention = io_spec.attention_of(i.name for i in self.session.get_inputs())
        want = [s.name for s in io_spec.inputs(cfg, self.n_layers, self.attention)]
        if [i.name for i in self.session.get_inputs()] != want:
            raise UserError(f"{path} was exported by an older version of spork_trt (its inputs differ from this "
                            "version's): rebuild the engines with `python -m export build`")
        self.names = io_spec.kv_names(self.n_layers, self.attention)
        self.taps = tuple(taps)  # the graph's io_spec.HIDDEN output: hidden states after these layers
        outs = {o.name for o in self.session.get_outputs()}
        if bool(self.taps) != (io_spec.HIDDEN in outs):
            raise UserError(f"{path} {'lacks' if self.taps else 'has'} the {io_spec.HIDDEN} output its manifest "
                            "entry says: rebuild the engines with `python -m export build`")
        self.min_rows = min_rows  # 2: no forward runs the one-row kernels (row_invariance.py); 1: as asked
        self.max_new = max_new  # most new tokens per forward (logits buffer rows)
        self.logits = np.zeros((max_new, cfg.vocab_size), dtype=np.float32)  # [Tmax, V]
        self.scratch: dict[str, np.ndarray] = {}  # flat buffers of batched forwards, kept between them
        # past rows of batched forwards, each used by the batch it overlaps most: three, so that the batches that
        # follow the same requests step after step keep their own (the step's tree batch and its prefill batch;
        # an early-exit engine's scoring batch and its drafting depths)
        self.stagings = [Staging(self.n_layers, cfg.n_kv_heads, cfg.head_dim, bnsh=self.gqa) for _ in range(3)]
        # GQA: IO bindings with every layer's KV buffers bound (about 120 bindings, ~0.5 ms a forward), kept while
        # the buffers stay: one per staging (its buffer, batch size) and one for the one-sequence path (the cache
        # it last ran): a forward rebinds only its token inputs and outputs. key -> (buffers, batch size, binding)
        self.kv_bindings: dict[int, tuple[tuple[np.ndarray, ...], int, object]] = {}

    @property
    def cfg(self) -> ModelConfig:
        return self._cfg

    @property
    def gqa(self) -> bool:
        return self.attention == io_spec.GQA

    @property
    def padded_batches(self) -> bool:
        """The GQA graph packs a batch's tokens: it costs their sum."""
        return not self.gqa

    def make_cache(self, max_len: int) -> Rows:
        return self.make_pool(1, max_len).caches[0]

    def make_pool(self, slots: int, max_len: int) -> KVPool:
        hkv, d = self._cfg.n_kv_heads, self._cfg.head_dim
        inner = (hkv, max_len) if self.gqa else (max_len, hkv)
        shape = (self.n_layers, slots, *inner, d)  # [L, slots, Smax, Hkv, D] (GQA: [L, slots, Hkv, Smax, D])
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)  # untouched pages cost no memory yet
        axis = 3 if self.gqa else 2
        return KVPool([Rows(k[:, s:s + 1], v[:, s:s + 1], axis=axis) for s in range(slots)])

    def forward_batch(self, seqs: list[SeqInput], hidden: list | None = None) -> list[torch.Tensor]:
        """One padded forward over B sequences: input_ids, position_ids [B, T] (T = the most new tokens), each
        layer's past rows of the whole batch from a Staging (P about the longest context; each sequence sees only its
        own), new rows copied back into each sequence's cache. One sequence binds its rows in place (`forward`).
        With `min_rows` 2, every sequence of one token gets a dummy row (row_invariance.py)."""
        pad = pad_to_rows(seqs, self.min_rows)
        if pad:
            return forward_padded(self.forward_batch, seqs, hidden, pad)
        if len(seqs) == 1:
            return super().forward_batch(seqs, hidden)
        self.check_hidden(hidden)
        caches = [s.cache for s in seqs]
        stage = max(self.stagings, key=lambda st: st.overlap(caches))  # the tree batch's and the prefill batch's
        if self.gqa:
            return self._batch_gqa(seqs, stage, hidden)
        hkv, d = self._cfg.n_kv_heads, self._cfg.head_dim
        past = stage.past(caches)  # [K|V, L, Bcap, P, Hkv, D]
        b, p = len(seqs), past.shape[3]
        batch = Padded.of(seqs, p)
        t, ctx = batch.input_ids.shape[1], batch.context
        new = self._scratch("new", (2, self.n_layers, b, t, hkv, d))  # [K|V, L, B, T, Hkv, D]
        io, logits, feats = self._bind_batch(batch, {})
        for layer, (pk, pv, nk, nv) in enumerate(self.names):
            for j, (pname, nname) in enumerate(((pk, nk), (pv, nv))):
                bind(io, pname, past[j, layer, :b])  # [B, P, Hkv, D]
                bind(io, nname, new[j, layer], out=True)  # [B, T, Hkv, D]
        self.session.run_with_iobinding(io)
        for i, s in enumerate(seqs):
            n, c = len(s.tokens), s.cache
            c.k[:self.n_layers, 0, ctx[i]:ctx[i] + n] = new[0, :, i, :n]
            c.v[:self.n_layers, 0, ctx[i]:ctx[i] + n] = new[1, :, i, :n]
        return self._finish(seqs, batch, logits, feats, hidden)

    def _batch_gqa(self, seqs: list[SeqInput], stage: Staging, hidden: list | None) -> list[torch.Tensor]:
        """The GQA graph over B sequences, their tokens packed: each layer's staged buffer [B, Hkv, Pcap, D] is both
        past and present, so the op writes each sequence's new rows after its own context there; they are copied to
        the caches after."""
        batch = Padded.of(seqs, absolute=True, packed=True)
        (b, t, width), ctx = batch.mask.shape, batch.context
        # the op wants room for every sequence's padded chunk after its context: Pcap >= max(context) + T
        past = stage.past([s.cache for s in seqs], need=max(ctx) + t)  # [K|V, L, Bcap, Hkv, Pcap, D]
        lens = io_spec.gqa_feeds([len(s.tokens) for s in seqs], ctx, width)  # bound by address: alive until run
        io = self.kv_binding(id(stage), (past,), b, lambda layer, j: past[j, layer, :b])  # [B, Hkv, Pcap, D] each
        io, logits, feats = self._bind_batch(batch, lens, io)
        self.session.run_with_iobinding(io)
        for i, s in enumerate(seqs):
            rows, c = slice(ctx[i], ctx[i] + len(s.tokens)), s.cache
            c.k[:self.n_layers, 0, :, rows] = past[0, :, i, :, rows]
            c.v[:self.n_layers, 0, :, rows] = past[1, :, i, :, rows]
        return self._finish(seqs, batch, logits, feats, hidden)

    def kv_binding(self, key: int, bufs: tuple[np.ndarray, ...], b: int, rows) -> object:
        """GQA: an IO binding with every layer's K and V bound as both past and present, made once per (`bufs`,
        `b`) under `key` and reused while they stay. `rows(layer, j)`: layer's K (j = 0) or V (j = 1) buffer
        [b, Hkv, Smax, D], a view of `bufs`; the op appends each sequence's new rows in place."""
        kept = self.kv_bindings.get(key)
        if kept is not None and kept[1] == b and all(x is y for x, y in zip(kept[0], bufs)):
            return kept[2]
        io = self.session.io_binding()
        for layer, (pk, pv, nk, nv) in enumerate(self.names):
            for j, (pname, nname) in enumerate(((pk, nk), (pv, nv))):
                bind(io, pname, rows(layer, j))
                bind(io, nname, rows(layer, j), out=True)
        self.kv_bindings[key] = (bufs, b, io)
        return io

    def _bind_batch(self, batch: Padded, lens: dict[str, np.ndarray], io=None):
        """An IO binding (`io`, or a new one) with a batch's token inputs (and GQA's lengths) bound; its logits
        [R, V] and hidden [B, T, k*C] (packed: [1, N, k*C]) or None outputs bound to scratch buffers.
        Binding is by address: the caller keeps `batch` and `lens` alive until the run."""
        b, t = batch.input_ids.shape  # [B, T] (packed: [1, N])
        io = io or self.session.io_binding()
        feeds = {"input_ids": batch.input_ids.numpy(), "position_ids": batch.position_ids.numpy(),
                 "attention_mask": batch.mask.numpy(), "logit_rows": batch.logit_rows.numpy(), **lens}
        for name, arr in feeds.items():
            bind(io, name, arr)
        logits = self._scratch("logits", (len(feeds["logit_rows"]), self._cfg.vocab_size))  # [R, V]
        bind(io, "logits", logits, out=True)
        return io, logits, self._bind_hidden(io, b, t)

    def _finish(self, seqs: list[SeqInput], batch: Padded, logits: np.ndarray, feats: np.ndarray | None,
                hidden: list | None) -> list[torch.Tensor]:
        """After a batched forward: each sequence's new rows are pending; its hidden states [n_b, k*C] appended to
        `hidden`; its logits [r_b, V]."""
        for i, s in enumerate(seqs):
            if hidden is not None:
                hidden.append(torch.from_numpy(feats[batch.rows(i, len(s.tokens))].copy()))  # [n_b, k*C]
            s.cache.written(len(s.tokens))
        return batch.split(torch.from_numpy(logits.copy()))  # [r_b, V] each

    def _bind_hidden(self, io, b: int, t: int) -> np.ndarray | None:
        """Bind the graph's hidden-state output (when it has one) to a scratch buffer [B, T, k*C]."""
        if not self.taps:
            return None
        feats = self._scratch(io_spec.HIDDEN, (b, t, len(self.taps) * self._cfg.dim))
        bind(io, io_spec.HIDDEN, feats, out=True)
        return feats

    def _scratch(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A contiguous array of `shape` over a flat float32 buffer kept between batches (grown on demand). Fresh
        buffers are zeros and only ever hold finite values, so masked-off rows never turn a softmax into NaN."""
        n = int(np.prod(shape))
        buf = self.scratch.get(name)
        if buf is None or buf.size < n:
            buf = self.scratch[name] = np.zeros(max(n, 1), np.float32)
        return buf[:n].reshape(shape)

    def forward(self, c: Rows, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None, hidden: list | None = None) -> torch.Tensor:
        """input_ids, position_ids [1, T] over cache `c` (k, v: [L, 1, Smax, Hkv, D] numpy buffers; GQA: [L, 1, Hkv,
        Smax, D]); mask [1, T, length + pending + T] -> logits [1, R, V] at `rows` (None: all T)."""
        t = input_ids.shape[1]
        past = c.length + c.pending
        assert input_ids.shape[0] == 1, "the ONNX Runtime engine runs batch 1 per sequence"
        assert mask.shape[-1] == past + t, (mask.shape, past)
        if past + t > c.max_len:
            raise ValueError(f"KV cache full: {past + t} positions needed, {c.max_len} allocated")
        at = np.arange(t, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)  # [R]
        r = len(at)
        if r == 0:  # none asked for: row 0 stands in (no engine sees an empty tensor)
            at = np.zeros(1, dtype=np.int64)
        if len(at) > self.logits.shape[0]:
            self.logits = np.zeros((len(at), self._cfg.vocab_size), dtype=np.float32)
        # GQA: the whole buffer is past and present (the op appends after row `past`), bound once per cache
        io = (self.kv_binding(SEQUENCE, (c.k, c.v), 1, lambda layer, j: (c.k, c.v)[j][layer, 0][None]) if self.gqa
              else self.session.io_binding())
        feeds = {"input_ids": np.ascontiguousarray(input_ids.numpy(), dtype=np.int64),
                 "position_ids": np.ascontiguousarray(position_ids.numpy(), dtype=np.int64),
                 "attention_mask": np.ascontiguousarray(mask.numpy(), dtype=np.bool_), "logit_rows": at}
        if self.gqa:
            feeds |= io_spec.gqa_feeds([t], [past], past + t)
        for name, arr in feeds.items():
            bind(io, name, arr)
        if not self.gqa:
            for layer, (pk, pv, nk, nv) in enumerate(self.names):
                for buf, pname, nname in ((c.k, pk, nk), (c.v, pv, nv)):
                    bind_rows(io, buf[layer, 0], pname, nname, past, t)  # [Smax, Hkv, D], contiguous
        logits = self.logits[:len(at)]  # [R, V]
        bind(io, "logits", logits, out=True)
        feats = self._bind_hidden(io, 1, t)  # [1, T, k*C] or None
        self.session.run_with_iobinding(io)
        c.written(t)
        if hidden is not None:
            self.check_hidden(hidden)
            hidden.append(torch.from_numpy(feats[0].copy()))  # [T, k*C]
        return torch.from_numpy(logits[None, :r].copy())


def bind_rows(io, rows: np.ndarray, past_name: str, new_name: str, past: int, t: int) -> None:
    """io_spec.PLAIN, one sequence: its first `past` rows of a [Smax, ...] buffer as the past input, in place, and
    the next `t` rows as the new-rows output (ONNX Runtime writes them straight after)."""
    bind(io, past_name, rows[None, :past])
    bind(io, new_name, rows[None, past:past + t], out=True)


def bind(io, name: str, arr: np.ndarray, out: bool = False) -> None:
    """Bind a contiguous numpy array (no copy) as a graph input or output."""
    assert arr.flags.c_contiguous, name
    (io.bind_output if out else io.bind_input)(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
