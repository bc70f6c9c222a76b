"""The reference model in bf16 on a CPU (`--device cpu --dtype bf16 | int4`): its matmuls on oneDNN's prepacked
bf16 kernels, or (int4) on a 4-bit kernel over the checkpoint's own 4-bit blocks with the rest in bf16
(engines/cpu/linears.py, engines/cpu/avx512_matmul.cpp): the levers that flatten the forward's cost curve on a CPU with
bf16 dot products (AVX512-BF16, AMX) and cut the bytes it reads, measured in docs/engines.md. No torch.compile: that
took 35-70 s per shape on 2 cores and was not cached across processes.

It runs over the device engine's pools and slots, its layers in TorchScript (engines/cpu/forward.py: eager ATen ops
without Python between them), only the slots of the sequences in a forward (B = their
number, T = the most new tokens of one: no static shapes, nothing to capture), with two differences that make it
lossless:

- The forward attends only the positions its sequences reach, rounded up to CTX_ROUND (the device engine attends
  the whole slot), and its columns are absolute positions: a layer writes its new K/V rows into the pool first
  (one index_put_), then attends positions [0, C). Where spork's CPU kernels are built, spork::attend reads the
  pool in place and sums only the attended columns, in order (engines/cpu/avx512_attention.cpp: row-, batch- and
  window-invariant by construction; cpu_forward.fused_layers); else bmms over a copy of the window, as follows. A
  chain token's softmax and P @ V terms then sit at the same columns whether it is computed alone or inside a
  chain, so they are summed in the same order (with bf16
  rounding after the sum, another order changed the argmax within 16 tokens); past 1024 columns P @ V is summed in
  chunks of 1024 (cpu_forward.attend: oneDNN's order there depends on C). A tree's rows sit elsewhere than the
  same tokens of a chain, so this engine verifies chains (`exact_trees` False), as a quantized ONNX target does.
- oneDNN picks another kernel for a matmul of one row than for two or more (on an AVX512-BF16 EPYC, 1 row in 4 of
  the MLP's down projection differs in the last bit), so a forward with a bf16 layer runs at least `row_floor` rows
  (B x T), padding with rows nobody reads; the LM head (bf16 in both) runs at the asked-for rows only, at least
  `head_floor` of them. The int4 kernel computes each row alone, so an int4 body runs one row when one is asked;
  so does the int4 engine's head where the checkpoint holds it as Q8_0 blocks (Q8Linear: fp32 logits).

  forward   ids, pos, write [B, T] (padding rows write the scratch position); mask [B, T, C] over positions ->
            logits [R, V] at the asked-for rows only (hidden [B, T, k*C'] with taps); the pool's K/V [L, slots, Hkv,
            Smax + 1, D] written in place at `write`
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from spork_trt.errors import UserError
from spork_trt.checkpoint.gguf_blocks import INT4_KINDS, KEPT, Blocks, blocks_by_parameter
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.engines.cpu import forward as cpu_forward, kernels as int4_kernel
from spork_trt.engines.cpu.linears import PackedLinear, Q8Linear, computes, pack_linears, require_onednn
from spork_trt.engines.cpu.linears import onednn_bf16_available  # noqa: F401 - where callers have asked for it
from spork_trt.config import EVERY_FEATURE
from spork_trt.engines.cpu.family_forward import family_weights
from spork_trt.engines.device_engine import DeviceEngine, Pool

CTX_ROUND = 64  # a forward attends positions [0, C), C a multiple of this (each step copies that window)
ROW_FLOOR = 2  # rows a forward with a bf16 matmul runs at least (measured: tests/test_onednn_engine.py, docs/engines.md)
FEATURES = EVERY_FEATURE  # beyond Llama's decoder (config.Architecture.features): every family's, on family_forward


@contextmanager
def built_on_one_thread():
    """Torch work inside runs on one OpenMP thread. Build a CPU engine (its checkpoint load included) this way when
    another thread will run its forwards (the server's engine core): a thread that ran a parallel region keeps its
    OpenMP team, and with more OpenMP threads alive than cores libgomp stops spinning between regions, so every
    matmul waits for its workers to wake (measured: the bf16 engine decoding on another thread than the one that
    built it, 29 tokens/s against 60; built on one thread, 60)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class WindowKV:
    """model.KVStore over some slots of the pool: a layer's new rows are written in place at `write` positions,
    then it attends the first C positions of those slots (a window of the pool when the slots are consecutive, else
    gathered: a slower copy; the matmuls give the same bits on either; `window_members`)."""

    def __init__(self, pool: Pool, slots: list[int], write: torch.Tensor, c: int) -> None:
        self.pool, self.c = pool, c
        self.slots = torch.tensor(slots)  # [B]
        self.write = write  # [B, T]
        self.at = (self.slots[:, None, None], torch.arange(pool.k.shape[2])[None, :, None],
                   write[:, None, :])  # write [B, T]; broadcast to [B, Hkv, T] over a layer's [slots, Hkv, S, D]
        first = slots[0]
        self.window = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, T, D] -> keys, values [B, Hkv, C, D]."""
        self.pool.k[layer].index_put_(self.at, k.to(self.pool.k.dtype))
        self.pool.v[layer].index_put_(self.at, v.to(self.pool.v.dtype))
        slots = self.slots if self.window is None else self.window
        return self.pool.k[layer, slots, :, :self.c], self.pool.v[layer, slots, :, :self.c]


class OneDnnEngine(DeviceEngine):
    """A CPU target in bf16 or int4: the device engine's pools and slots, prepacked or int4 matmuls, windowed
    absolute attention (see the module doc)."""

    # a tree's rows attend their ancestors at other columns than a chain's: on the bmm path only chains are exact.
    # On spork::attend trees are exact too (tests/test_onednn_engine.py), but measured slower than chains (int4,
    # bench serve mt_bench: spork / plain 1.08x against 1.32x at 1 client, 0.90x against 0.93x at 16): chains
    exact_trees = False
    name = "the CPU torch engine"
    features = FEATURES
    weight_paths = ""  # int4: which block types run how (cpu_target's startup line)
    padded_batches = False  # its linear layers run the real rows only (cpu_forward: packed rows)
    chunks_apart = True  # but its attention runs [B, T]: a prompt chunk beside the trees would pad them all

    def __init__(self, model: Transformer, taps: tuple[int, ...] = (), blocks: dict[str, Blocks] | None = None,
                 row_floor: int | None = None, head: Blocks | None = None) -> None:
        """`blocks` (parameter name -> the checkpoint's blocks, gguf_blocks.blocks_by_parameter): the weights held
        in 4 bits run on Int4Linear, the rest on bf16 PackedLinear; `head`: the LM head's Q8_0 blocks, run on
        Q8Linear where spork's kernels are built. `row_floor` (default: ROW_FLOOR when a layer has a bf16 matmul,
        else 1): rows a forward runs at least; the LM head runs at least ROW_FLOOR rows when it is bf16."""
        if blocks is None:
            require_onednn()  # with blocks, a weight left in bf16 asks for oneDNN (PackedLinear)
        super().__init__(model, "cpu", "bf16", taps, graphs=False, lookahead=0)
        if head is not None and int4_kernel.kernel() == "spork":
            self.model.lm_head = Q8Linear(head)  # before pack_linears, which packs every nn.Linear left
        biases = qkv_biases(self.model)  # before pack_linears, whose linears have none
        pack_linears(self.model, blocks or {})
        self.weights = cpu_forward.layer_weights(self.model)
        arch = self.model.cfg.arch
        self.family = family_weights(self.model, biases) if arch.features() else None  # family_forward's layers
        bf16_body = any(isinstance(m, PackedLinear) for m in self.model.layers.modules())
        self.row_floor = (ROW_FLOOR if bf16_body else 1) if row_floor is None else row_floor
        self.head_floor = ROW_FLOOR if isinstance(self.model.lm_head, PackedLinear) else 1

    def make_pool(self, slots: int, max_len: int):
        with built_on_one_thread():  # zeroing a large pool runs parallel on the caller: see built_on_one_thread
            return super().make_pool(slots, max_len)

    @torch.inference_mode()
    def run(self, entries: list[tuple], hidden: list | None) -> list[torch.Tensor]:
        """entries: (cache, tokens [n], positions [n], mask [n, context + n] over the cache's rows, logit rows). Only
        the entries' own slots run (the device engine runs every slot below the highest, for its static shapes), in
        slot order, with the few free slots between them as padding sequences (`window_members`)."""
        pool, slots = self.slots_of(entries)
        members = window_members(slots, pad=not self.weights.fused)  # [B]: an entry's index, or None for a free
        # slot in the window (spork::attend reads any slots in place: no window to pad to)
        b = len(members)
        t = max(max(len(e[1]) for e in entries), -(-self.row_floor // b))  # at least row_floor rows in all
        bases = [cache.length + cache.pending for cache, *_ in entries]
        end = max(base + len(e[1]) for base, e in zip(bases, entries))
        c = min(-(-end // CTX_ROUND) * CTX_ROUND, pool.scratch)  # columns: absolute positions [0, C)
        ids = torch.zeros(b, t, dtype=torch.long)
        pos = torch.zeros(b, t, dtype=torch.long)
        write = torch.full((b, t), pool.scratch, dtype=torch.long)  # padding rows write the scratch position
        mask = torch.zeros(b, t, c, dtype=torch.bool)
        mask[:, :, 0] = True  # padding rows attend position 0 (their outputs are not read)
        real, flat, starts = [], {}, {}  # real rows (flat b * t + r), per entry its asked rows and first row, packed
        for i, e in enumerate(members):
            if e is None:
                continue
            (cache, tokens, positions, m, rows), base = entries[e], bases[e]
            n = len(tokens)
            ids[i, :n], pos[i, :n] = torch.tensor(tokens), torch.tensor(positions)
            write[i, :n] = torch.arange(base, base + n)
            mask[i, :n, :base + n] = m
            starts[e] = len(real)
            flat[e] = [len(real) + r for r in rows]
            real.extend(range(i * t, i * t + n))
        if len(real) < self.row_floor:  # padding rows up to the row floor, after every real one
            real += sorted(set(range(b * t)) - set(real))[:self.row_floor - len(real)]
        asked = [r for e in range(len(entries)) for r in flat[e]]  # in the entries' order
        rows = torch.tensor(asked + [0] * max(self.head_floor - len(asked), 0), dtype=torch.long)  # the LM head's
        # rows: the asked-for ones, at least head_floor of them
        first = min(slots)  # a free slot in the window sits at first + its place
        kv = WindowKV(pool, [slots[e] if e is not None else first + i for i, e in enumerate(members)], write, c)
        out = cpu_forward.forward(self.model, self.weights, ids, pos, mask, kv, self.taps if hidden is not None else (),
                                  rows, torch.tensor(real), self.family)
        for e, (cache, tokens, *_) in enumerate(entries):
            cache.written(len(tokens))
            if hidden is not None:
                hidden.append(out.hidden[starts[e]:starts[e] + len(tokens)].float())  # [n, k*C]
        logits = out.logits[:len(asked)].float()  # [R, V]
        return list(torch.split(logits, [len(e[4]) for e in entries]))


def qkv_biases(model: Transformer) -> list[torch.Tensor]:
    """Each layer's q, k and v biases side by side [(H + 2 Hkv) D] (Qwen2's), or [] where the family has none."""
    if not model.cfg.arch.qkv_bias:
        return []
    return [torch.cat([a.wq.bias, a.wk.bias, a.wv.bias]).detach() for a in (blk.attn for blk in model.layers)]


def window_members(slots: list[int], pad: bool = True) -> list[int | None]:
    """The sequences of a forward in slot order: each entry's index, by its slot. When the slots, with at most a
    quarter as many free ones between them, make one run, the free ones join as padding sequences (None) and the
    forward attends one window of the pool (a contiguous copy; gathering scattered slots copied 1.4x slower and
    16 scattered sequences took 36 ms a forward against 26 ms consecutive, int4, 100-655 tokens each). Without
    `pad` (spork::attend, which reads any slots in place), slot order only."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    span = slots[order[-1]] - slots[order[0]] + 1
    if not pad or span - len(slots) > len(slots) // 4:
        return order
    by_slot = dict(zip((slots[i] for i in order), order))
    return [by_slot.get(s) for s in range(slots[order[0]], slots[order[0]] + span)]


def cpu_target(ck, dtype: str, taps: tuple[int, ...] = ()) -> OneDnnEngine:
    """Checkpoint `ck` on this engine: bf16, or int4: its block weights on their own blocks (Q4_0 / Q4_1 anywhere;
    where spork's kernels are built also Q4_K, Q5_0, Q5_1, Q5_K and Q8_0, linears.computes), its Q8_0 LM head or
    the embedding it is tied to on q8_mm there, the rest (Q6_K, F16, ...) bf16."""
    if dtype != "int4":
        return OneDnnEngine(ck.model, taps)
    kept = blocks_by_parameter(ck)
    blocks = {name: b for name, b in kept.items() if computes(b.kind) and name != "embed.weight"}
    if not blocks:
        kinds = KEPT if int4_kernel.kernel() == "spork" else INT4_KINDS
        raise UserError(f"--dtype int4 computes a GGUF checkpoint's own blocks ({', '.join(kinds)} on this machine): "
                        f"{ck.path} has none; use --dtype bf16")
    engine = OneDnnEngine(ck.model, taps, blocks, head=head_blocks(ck.model, kept))
    engine.weight_paths = weight_paths(ck.path, isinstance(engine.model.lm_head, Q8Linear))
    return engine


def file_weight_paths(gguf_path) -> str:
    """weight_paths from the file's tensor table alone (`export inspect`): its LM head (or the embedding it is tied
    to) runs on its Q8_0 blocks where spork's kernels are built."""
    from spork_trt.checkpoint.weights import gguf_reader

    kinds = {t.name: t.tensor_type.name for t in gguf_reader(gguf_path).tensors}
    head = kinds.get("output.weight", kinds.get("token_embd.weight"))
    return weight_paths(gguf_path, head == "Q8_0" and int4_kernel.kernel() == "spork")


def weight_paths(gguf_path, q8_head: bool) -> str:
    """One line for startup: which of the file's layer block types run on their own blocks, which in bf16."""
    from spork_trt.checkpoint.weights import gguf_reader

    layers = sorted({t.tensor_type.name for t in gguf_reader(gguf_path).tensors
                     if t.name.startswith("blk.") and len(t.shape) >= 2})
    own, bf16 = [k for k in layers if computes(k)], [k for k in layers if not computes(k)]
    return (f"{'/'.join(own)} layer weights on their own blocks ({int4_kernel.arithmetic()})"
            + (f", {'/'.join(bf16)} in bf16 (oneDNN)" if bf16 else "")
            + (", the Q8_0 LM head on its blocks" if q8_head else ", the LM head in bf16"))


def head_blocks(model: Transformer, kept: dict[str, Blocks]) -> Blocks | None:
    """The LM head's Q8_0 blocks: its own, or the embedding's when the head is tied to it (the same weight)."""
    head = kept.get("lm_head.weight")
    if head is None and "embed.weight" in kept and torch.equal(model.lm_head.weight, model.embed.weight):
        head = kept["embed.weight"]
    return head if head is not None and head.kind == "Q8_0" else None
