"""Micro-benchmark: ONE attention layer of the default model (H=9, Hkv=3, D=64, C=576, fp32) on ONNX Runtime CPU.

(A) "padded": what the io_spec.PLAIN graph's attention does (spork_trt/export/lean.py LeanAttention.forward),
    minus the q/k/v projections, rotary and wo:
    q [B,T,H*D], k/v new [B,T,Hkv,D], past_k/past_v [B,P,Hkv,D] (dense staging, P = longest context rounded up
    to 16), additive bias [B,1,G*T,P+T] already tiled (LeanGraph tiles it once per forward, outside the layers)
    -> Concat(past,new) on positions, q@K^T / sqrt(D), + bias, Softmax, @V -> out [B,T,H*D]; the new k/v rows
    are graph outputs too (Identity -> bound buffers; stands for the Slice copies of the real graph).
    "copies": the numpy copies the engine does around a forward (onnx_engine.forward_batch + staging.Staging.past):
    per sequence, new rows -> its pool slot (K and V), and the committed rows -> the staging buffer (K and V),
    T rows each, done with the engine's all-layer statements over L layers, divided by L (per-layer share).
(B) "gqa": what the io_spec.GQA graph (the default since lean-3) does: one com.microsoft.GroupQueryAttention
    node (causal=1, query_seqlens, seqlens_k = ctx_b + T - 1, total_sequence_length = max_b(ctx_b) + T,
    attention_bias [B,1,T,S]) with one BNSH buffer [B,Hkv,Smax,D] bound
    as both past and present (in-place append), no copies around it.

Both run with IOBinding to preallocated numpy buffers; A and B are timed interleaved (A, B, A, B, ...) so load
from other processes hits both alike; median of the repeats after warm-up. Every case first checks that A and B
give the same attention output (max abs diff < 1e-4) and that B appended the new rows in place.

    .venv/bin/python bench/layout_probe.py            # full (about 35 s on 2 cores)
    .venv/bin/python bench/layout_probe.py --quick    # smoke: tiny, seconds
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

H, HKV, D = 9, 3, 64
G = H // HKV
NEG = float(np.finfo(np.float32).min)  # spork_trt.checkpoint.transformer.mask_bias's masked value
ROW_BLOCK = 16  # spork_trt.engines.staging.ROW_BLOCK
F = TensorProto.FLOAT


def _opset(m: onnx.ModelProto) -> onnx.ModelProto:
    m.ir_version = 9
    return m


def padded_model() -> onnx.ModelProto:
    """LeanAttention.forward's attention core, op for op (torch: cat, reshape(transpose), matmul, /sqrt, +bias,
    softmax, matmul, reshape(transpose))."""
    c = lambda name, vals: helper.make_node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name + "_t", TensorProto.INT64, [len(vals)], vals))
    nodes = [
        c("s_bthd", [0, 0, H, D]), c("s_bkgd", [0, HKV, -1, D]), c("s_bhtd", [0, H, -1, D]), c("s_btc", [0, -1, H * D]),
        helper.make_node("Constant", [], ["scale"], value=helper.make_tensor("scale_t", F, [], [math.sqrt(D)])),
        helper.make_node("Concat", ["past_k", "k"], ["keys"], axis=1),  # [B,S,Hkv,D]
        helper.make_node("Concat", ["past_v", "v"], ["values"], axis=1),
        helper.make_node("Reshape", ["q", "s_bthd"], ["q4"]),  # [B,T,H,D]
        helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),  # [B,H,T,D]
        helper.make_node("Reshape", ["qt", "s_bkgd"], ["qg"]),  # [B,Hkv,G*T,D]
        helper.make_node("Transpose", ["keys"], ["kt"], perm=[0, 2, 3, 1]),  # [B,Hkv,D,S]
        helper.make_node("MatMul", ["qg", "kt"], ["s0"]),
        helper.make_node("Div", ["s0", "scale"], ["s1"]),
        helper.make_node("Add", ["s1", "bias"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("Transpose", ["values"], ["vt"], perm=[0, 2, 1, 3]),  # [B,Hkv,S,D]
        helper.make_node("MatMul", ["p", "vt"], ["o0"]),  # [B,Hkv,G*T,D]
        helper.make_node("Reshape", ["o0", "s_bhtd"], ["o1"]),  # [B,H,T,D]
        helper.make_node("Transpose", ["o1"], ["o2"], perm=[0, 2, 1, 3]),  # [B,T,H,D]
        helper.make_node("Reshape", ["o2", "s_btc"], ["out"]),
        helper.make_node("Identity", ["k"], ["new_k"]),
        helper.make_node("Identity", ["v"], ["new_v"]),
    ]
    vi = helper.make_tensor_value_info
    inputs = [vi("q", F, ["B", "T", H * D]), vi("k", F, ["B", "T", HKV, D]), vi("v", F, ["B", "T", HKV, D]),
              vi("past_k", F, ["B", "P", HKV, D]), vi("past_v", F, ["B", "P", HKV, D]),
              vi("bias", F, ["B", 1, "GT", "S"])]
    outputs = [vi("out", F, ["B", "T", H * D]), vi("new_k", F, ["B", "T", HKV, D]), vi("new_v", F, ["B", "T", HKV, D])]
    g = helper.make_graph(nodes, "padded_attn", inputs, outputs)
    return _opset(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def gqa_model() -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    node_in = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
               "", "", "", "attention_bias", "", "", "", "", "", "query_seqlens"]
    # input slots (as in probe.py): 7,8 cos/sin_cache, 9 position_ids, 10 attention_bias, 11-15 head_sink,
    # k_scale, v_scale, q_norm_weight, k_norm_weight (unused), 16 query_seqlens
    inputs = [vi("query", F, ["B", "T", H * D]), vi("key", F, ["B", "T", HKV * D]), vi("value", F, ["B", "T", HKV * D]),
              vi("past_key", F, ["B", HKV, "Smax", D]), vi("past_value", F, ["B", HKV, "Smax", D]),
              vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, []),
              vi("attention_bias", F, ["B", 1, "T", "S"]), vi("query_seqlens", TensorProto.INT32, ["B"])]
    node = helper.make_node("GroupQueryAttention", node_in, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=HKV, causal=1)
    outputs = [vi("output", F, ["B", "T", H * D]), vi("present_key", F, ["B", HKV, "Smax", D]),
               vi("present_value", F, ["B", HKV, "Smax", D])]
    g = helper.make_graph([node], "gqa_attn", inputs, outputs)
    return _opset(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]))


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def random_tree(rng, t: int) -> np.ndarray:
    """Ancestor-or-self mask [T,T] of a random tree in topological order (node 0 the root)."""
    anc = np.eye(t, dtype=bool)
    for j in range(1, t):
        anc[j] |= anc[rng.integers(0, j)]
    return anc


def bind(io, name: str, arr: np.ndarray, out: bool = False) -> None:
    (io.bind_output if out else io.bind_input)(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)


class Case:
    def __init__(self, b: int, t: int, ctx0: int, smax: int, layers: int, sess_a, sess_b, rng) -> None:
        self.b, self.t = b, t
        self.ctx = np.array([ctx0 - ROW_BLOCK * i for i in range(b)])  # differ per sequence
        assert self.ctx.min() >= 0 and self.ctx.max() + t <= smax, (self.ctx, t, smax)
        self.p = -(-int(self.ctx.max()) // ROW_BLOCK) * ROW_BLOCK  # staging Pcap
        self.s_total = int(self.ctx.max()) + t  # GQA total_sequence_length (= bias last dim)
        f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
        self.q = f32(b, t, H * D)
        self.k, self.v = f32(b, t, HKV, D), f32(b, t, HKV, D)
        trees = [random_tree(rng, t) for _ in range(b)]

        # ---- (A) padded: staging rows [0, ctx_b) = the sequence's past, the rest stale finite values
        self.past_k, self.past_v = f32(b, self.p, HKV, D), f32(b, self.p, HKV, D)
        mask = np.zeros((b, t, self.p + t), bool)  # engines.Padded.of
        for i in range(b):
            mask[i, :, :self.ctx[i]] = True
            mask[i, :, self.p:self.p + t] = trees[i]
        bias = np.where(mask, np.float32(0), np.float32(NEG)).astype(np.float32)[:, None]  # [B,1,T,P+T]
        self.bias_a = np.ascontiguousarray(np.tile(bias, (1, 1, G, 1)))  # [B,1,G*T,P+T] (torch .repeat(1,1,G,1))
        self.out_a = np.zeros((b, t, H * D), np.float32)
        self.new_k, self.new_v = np.zeros_like(self.k), np.zeros_like(self.v)
        self.io_a = io = sess_a.io_binding()
        for name, arr in (("q", self.q), ("k", self.k), ("v", self.v), ("past_k", self.past_k),
                          ("past_v", self.past_v), ("bias", self.bias_a)):
            bind(io, name, arr)
        for name, arr in (("out", self.out_a), ("new_k", self.new_k), ("new_v", self.new_v)):
            bind(io, name, arr, out=True)
        self.sess_a = sess_a

        # ---- (B) gqa: BNSH cache, same past rows; rows >= ctx_b poisoned (a leak would show in the check)
        self.cache_k = np.full((b, HKV, smax, D), 1e3, np.float32)
        self.cache_v = np.full((b, HKV, smax, D), 1e3, np.float32)
        for i in range(b):
            c = self.ctx[i]
            self.cache_k[i, :, :c] = self.past_k[i, :c].transpose(1, 0, 2)
            self.cache_v[i, :, :c] = self.past_v[i, :c].transpose(1, 0, 2)
        self.key = self.k.reshape(b, t, HKV * D)  # views: same memory
        self.value = self.v.reshape(b, t, HKV * D)
        self.seqlens_k = (self.ctx + t - 1).astype(np.int32)
        self.total = np.array(self.s_total, np.int32)
        self.qlens = np.full(b, t, np.int32)
        bias_b = np.full((b, 1, t, self.s_total), np.float32(NEG), np.float32)  # key column = absolute position
        for i in range(b):
            c = self.ctx[i]
            bias_b[i, 0, :, :c] = 0.0
            bias_b[i, 0, :, c:c + t] = np.where(trees[i], 0.0, NEG)
        self.bias_b = bias_b
        self.out_b = np.zeros((b, t, H * D), np.float32)
        self.io_b = io = sess_b.io_binding()
        for name, arr in (("query", self.q), ("key", self.key), ("value", self.value), ("past_key", self.cache_k),
                          ("past_value", self.cache_v), ("seqlens_k", self.seqlens_k),
                          ("total_sequence_length", self.total), ("attention_bias", self.bias_b),
                          ("query_seqlens", self.qlens)):
            bind(io, name, arr)
        for name, arr in (("output", self.out_b), ("present_key", self.cache_k), ("present_value", self.cache_v)):
            bind(io, name, arr, out=True)
        self.sess_b = sess_b

        # ---- engine copies around a forward, all layers at once (as forward_batch / Staging.past do)
        self.layers = layers
        slots = b
        self.pool_k = np.zeros((layers, slots, smax, HKV, D), np.float32)  # make_pool: [L, slots, Smax, Hkv, D]
        self.pool_v = np.zeros_like(self.pool_k)
        self.slot_k = [self.pool_k[:, s:s + 1] for s in range(slots)]  # Rows views, indexed [:, 0, rows]
        self.slot_v = [self.pool_v[:, s:s + 1] for s in range(slots)]
        self.stage = np.zeros((2, layers, b, self.p + ROW_BLOCK, HKV, D), np.float32)  # [K|V, L, Bcap, Pcap, ..]
        self.new_all = rng.standard_normal((2, layers, b, t, HKV, D)).astype(np.float32)  # the "new" scratch

    def run_a(self) -> None:
        self.sess_a.run_with_iobinding(self.io_a)

    def run_b(self) -> None:
        self.sess_b.run_with_iobinding(self.io_b)

    def copies(self) -> None:
        t, new, st = self.t, self.new_all, self.stage
        for i in range(self.b):  # forward_batch: new rows into each sequence's cache
            c = int(self.ctx[i])
            self.slot_k[i][:, 0, c:c + t] = new[0, :, i, :t]
            self.slot_v[i][:, 0, c:c + t] = new[1, :, i, :t]
        for i in range(self.b):  # Staging.past (next forward): the newly committed rows into the staging buffer
            m = int(self.ctx[i])
            st[0, :, i, m:m + t] = self.slot_k[i][:, 0, m:m + t]
            st[1, :, i, m:m + t] = self.slot_v[i][:, 0, m:m + t]

    def check(self) -> dict:
        self.run_a()
        self.run_b()
        diff = float(np.abs(self.out_a - self.out_b).max())
        rows = max(float(np.abs(self.cache_k[i, :, c:c + self.t] - self.k[i].transpose(1, 0, 2)).max()) +
                   float(np.abs(self.cache_v[i, :, c:c + self.t] - self.v[i].transpose(1, 0, 2)).max())
                   for i, c in enumerate(self.ctx))
        # the padded result against a float64 numpy reference (first sequence, all heads)
        i, c, t = 0, int(self.ctx[0]), self.t
        qb = self.q[0].reshape(t, H, D).transpose(1, 0, 2).astype(np.float64)
        kk = np.concatenate([self.past_k[0, :c], self.k[0]], 0).transpose(1, 0, 2).astype(np.float64)
        vv = np.concatenate([self.past_v[0, :c], self.v[0]], 0).transpose(1, 0, 2).astype(np.float64)
        allow = np.concatenate([np.ones((t, c), bool), self.bias_a[0, 0, :t, self.p:] == 0], 1)
        ref = np.zeros((t, H * D))
        for h in range(H):
            s = np.where(allow, qb[h] @ kk[h // G].T / math.sqrt(D), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            ref[:, h * D:(h + 1) * D] = (pr / pr.sum(-1, keepdims=True)) @ vv[h // G]
        return dict(max_abs_diff_a_vs_b=diff, gqa_new_rows_err=rows,
                    a_vs_ref64=float(np.abs(self.out_a[0] - ref).max()))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(case: Case, budget_s: float, min_rep: int, max_rep: int, warm: int) -> dict:
    for _ in range(warm):
        case.run_a(); case.run_b(); case.copies()  # noqa: E702
    est = statistics.median([timed(case.run_a) + timed(case.run_b) for _ in range(3)])
    n = int(min(max_rep, max(min_rep, budget_s / max(est, 1e-6))))
    ta, tb = [], []
    for _ in range(n):  # interleaved
        ta.append(timed(case.run_a))
        tb.append(timed(case.run_b))
    est_c = timed(case.copies)
    nc = int(min(max_rep, max(min_rep, 0.2 * budget_s / max(est_c, 1e-6))))
    tc = [timed(case.copies) for _ in range(nc)]
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return dict(repeats=n, copy_repeats=nc, padded_ms=ms(ta), gqa_ms=ms(tb),
                copies_all_layers_ms=ms(tc), copies_ms=ms(tc) / case.layers,
                padded_p25_ms=1e3 * float(np.percentile(ta, 25)), padded_p75_ms=1e3 * float(np.percentile(ta, 75)),
                gqa_p25_ms=1e3 * float(np.percentile(tb, 25)), gqa_p75_ms=1e3 * float(np.percentile(tb, 75)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny contexts, few repeats (seconds)")
    ap.add_argument("--batches", type=int, nargs="+", help="default 1 4 16 (--quick: 1 4)")
    ap.add_argument("--tokens", type=int, nargs="+", help="default 1 4 8 (--quick: 1 4)")
    ap.add_argument("--ctx", type=int, help="context of sequence 0, sequence b has ctx - 16 b; default 512 "
                                            "(--quick: 64)")
    ap.add_argument("--smax", type=int, help="GQA cache capacity (and pool Smax); default 640 (--quick: 96)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the model (x column; copies share)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, help="seconds of interleaved A+B timing per case (copies get a fifth "
                                                 "more); default 5 (--quick: 0.1)")
    ap.add_argument("--out", help="JSON path; default results/layout/layout.json (--quick: layout_quick.json)")
    args = ap.parse_args()
    quick = dict(batches=[1, 4], tokens=[1, 4], ctx=64, smax=96, budget=0.1, out="results/layout/layout_quick.json")
    full = dict(batches=[1, 4, 16], tokens=[1, 4, 8], ctx=512, smax=640, budget=5.0, out="results/layout/layout.json")
    for k, v in (quick if args.quick else full).items():  # flags given explicitly win
        if getattr(args, k) is None:
            setattr(args, k, v)
    min_rep, max_rep, warm = (3, 10, 1) if args.quick else (20, 5000, 5)

    print(f"onnxruntime {ort.__version__}, threads {args.threads}, H={H} Hkv={HKV} D={D}, ctx0={args.ctx} "
          f"smax={args.smax}, layers={args.layers}", flush=True)
    sess_a, sess_b = session(padded_model(), args.threads), session(gqa_model(), args.threads)
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()
    rows, ok = [], True
    for b in args.batches:
        for t in args.tokens:
            case = Case(b, t, args.ctx, args.smax, args.layers, sess_a, sess_b, rng)
            chk = case.check()
            good = chk["max_abs_diff_a_vs_b"] < 1e-4 and chk["gqa_new_rows_err"] == 0.0 and chk["a_vs_ref64"] < 1e-4
            ok &= good
            print(f"check B={b} T={t} ctx={case.ctx.tolist() if b <= 4 else f'{case.ctx.max()}..{case.ctx.min()}'}"
                  f" P={case.p} S={case.s_total}: max|A-B|={chk['max_abs_diff_a_vs_b']:.2e} "
                  f"max|A-ref64|={chk['a_vs_ref64']:.2e} gqa new rows err={chk['gqa_new_rows_err']:.1e} "
                  f"{'OK' if good else 'MISMATCH'}", flush=True)
            m = measure(case, args.budget, min_rep, max_rep, warm)
            r = dict(B=b, T=t, P=case.p, S_total=case.s_total, ctx=case.ctx.tolist(), **chk, **m)
            r["padded_plus_copies_ms"] = m["padded_ms"] + m["copies_ms"]
            r["ratio"] = r["padded_plus_copies_ms"] / m["gqa_ms"]
            r["ratio_no_copies"] = m["padded_ms"] / m["gqa_ms"]
            rows.append(r)
            del case
    elapsed = time.perf_counter() - t_start

    L = args.layers
    lines = ["| B | T | P | padded ms | copies ms | padded+copies ms | gqa ms | ratio (A+copies)/gqa | "
             f"ratio A/gqa | x{L}: padded+copies ms | x{L}: gqa ms | x{L}: saved ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['T']} | {r['P']} | {r['padded_ms']:.3f} | {r['copies_ms']:.4f} | "
                     f"{r['padded_plus_copies_ms']:.3f} | {r['gqa_ms']:.3f} | {r['ratio']:.2f} | "
                     f"{r['ratio_no_copies']:.2f} | {L * r['padded_plus_copies_ms']:.2f} | {L * r['gqa_ms']:.2f} | "
                     f"{L * (r['padded_plus_copies_ms'] - r['gqa_ms']):.2f} |")
    table = "\n".join(lines)
    print()
    print(table)
    print(f"\nper-layer medians; copies = engine's all-layer numpy copies / {L}; timing took {elapsed:.1f}s; "
          f"correctness {'OK' if ok else 'FAILED'}")
    meta = dict(onnxruntime=ort.__version__, threads=args.threads, heads=H, kv_heads=HKV, head_dim=D,
                ctx0=args.ctx, smax=args.smax, layers=L, quick=args.quick, budget_s=args.budget,
                elapsed_s=elapsed, correctness_ok=ok)
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    from spork_trt import atomic

    with atomic.open(args.out) as f:
        json.dump(dict(meta=meta, rows=rows, table=table), f, indent=1)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
