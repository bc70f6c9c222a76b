"""`python -m bench gpu --profile`: where a speculative step's time goes on the device engine.

  forward   one slot's forward by tokens T (a chain after a 256-token context): the whole engine call (host
            inputs, graph replay, logits gathered, synchronised; in the bucket the engine picked, which lookahead
            may make larger than T's own) against the bare replay of T's own bucket's graph
  ops       torch.profiler over the store arm on the first prompts: the 20 ops with the most self CPU time and the
            20 with the most device time, as text tables (profile_cpu.txt, profile_device.txt); and cProfile over
            a second run: the 40 Python functions with the most own time (profile_py.txt)
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from spork_trt.engines import forward_chain
from spork_trt.engines.device_engine import T_BUCKETS, bucket

TOKENS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 256


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def forward_costs(engine, vocab: int, reps: int = 20) -> dict:
    """Milliseconds per forward of T tokens after CONTEXT rows: the engine call and its graph's bare replay."""
    out = {}
    for t in TOKENS:
        cache = engine.make_cache(CONTEXT + t + 1)
        ids = [int(i) % vocab for i in range(CONTEXT)]
        forward_chain(engine, cache, ids)
        cache.commit()
        step = [int(i) % vocab for i in range(t)]
        for _ in range(3):  # warm-up: captures the bucket's graph
            forward_chain(engine, cache, step)
            cache.forget(0)
        sync(engine)
        s = time.perf_counter()
        for _ in range(reps):
            forward_chain(engine, cache, step)
            cache.forget(0)
        call_ms = 1e3 * (time.perf_counter() - s) / reps
        pool = cache.device_slot[0]
        graph = pool.buckets[(1, bucket(t, T_BUCKETS))].graph
        replay_ms = None
        if graph is not None:
            sync(engine)
            s = time.perf_counter()
            for _ in range(reps):
                graph.replay()
            sync(engine)
            replay_ms = round(1e3 * (time.perf_counter() - s) / reps, 3)
        out[str(t)] = {"call_ms": round(call_ms, 3), "replay_ms": replay_ms, "bucket": engine.pick(pool, 1, t)}
    return out


def op_tables(run, out: Path) -> dict:
    """torch.profiler over `run()`, then cProfile over it again; writes the three tables, returns their names."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run()
    avg = prof.key_averages()
    files = {"cpu": "profile_cpu.txt", "device": "profile_device.txt", "py": "profile_py.txt"}
    (out / files["cpu"]).write_text(avg.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (out / files["device"]).write_text(avg.table(sort_by=key, row_limit=20, max_name_column_width=60))
    py, text = cProfile.Profile(), io.StringIO()
    py.runcall(run)
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(40)
    (out / files["py"]).write_text(text.getvalue())
    return files
