"""`n` choices of one request: the jobs that answer them and their events merged into one sequence.

Sampled, each choice is a request of its own with its own seed stream (the request's `seed` + i, or none: each a
random one); they run concurrently, so the engine core shares the prompt's rows among them where one's prefill is
done before another's begins (prefix reuse: loop/prefix_cache.py). Greedy, every choice is the same answer (as
OpenAI's are): one request, its events repeated for each index."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from spork_trt.serving.openai_api.answer import End, Text
from spork_trt.serving.openai_api.params import Job

SEEDS = 2**64 - 1  # SamplingConfig's seed range: [0, 2**64 - 1)


def choice_jobs(job: Job) -> list[Job]:
    """The requests that answer `job`'s n choices: n sampled ones, or one for greedy (repeated: `copies`)."""
    s = job.cfg.sampling
    if job.n == 1 or s.greedy:
        return [job]
    seeds = [None] * job.n if s.seed is None else [(s.seed + i) % SEEDS for i in range(job.n)]
    return [replace(job, cfg=replace(job.cfg, sampling=replace(s, seed=seed)), n=1) for seed in seeds]


def copies(job: Job, jobs: list[Job]) -> int:
    """How many choices each request's answer stands for: n for a greedy one, else 1."""
    return job.n if len(jobs) == 1 else 1


async def merged(answers: list[AsyncIterator[Text | End]], repeat: int) -> AsyncIterator[tuple[int, Text | End]]:
    """(choice index, event) from every answer as they come, until each has ended; one answer's events are
    repeated for indices 0..repeat-1. An answer's error ends the whole (the others' streams are cancelled by the
    caller)."""
    if len(answers) == 1:
        async for e in answers[0]:
            for i in range(repeat):
                yield i, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator[Text | End]) -> None:
        try:
            async for e in events:
                await queue.put((i, e, None))
        except Exception as x:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put((i, None, x))

    tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(answers)]
    try:
        left = len(answers)
        while left:
            i, e, error = await queue.get()
            if error is not None:
                raise error
            yield i, e
            left -= isinstance(e, End)
    finally:
        for t in tasks:
            t.cancel()
