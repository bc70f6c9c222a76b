"""The engine core's draft switch: proposing per batch size by measured tokens/s, futility, probes."""
from __future__ import annotations

from spork_trt.spec.draft_switch import FUTILE_BATCH, PROBE_EVERY, SWITCHED, DraftSwitch


def choices(sw: DraftSwitch, batch: int, n: int) -> list[bool]:
    return [sw.propose(batch) for _ in range(n)]


def test_one_request_always_proposes_and_teaches_nothing():
    sw = DraftSwitch()
    sw.record(1, True, 1, 10.0)
    sw.allotted([0] * 8)
    assert choices(sw, 1, 2 * PROBE_EVERY) == [True] * (2 * PROBE_EVERY) and not sw.rates


def test_a_batch_below_switched_always_proposes():
    """Below SWITCHED requests the allotment alone sizes the trees: neither a faster plain rate nor an empty
    allotment turns proposing off there (at 4 requests they kept it off for half of the steps), and such steps
    teach the switch nothing; from SWITCHED on both do."""
    sw = DraftSwitch()
    for b in (2, 4, SWITCHED - 1):
        sw.record(b, True, 1, 10.0)
        sw.record(b, False, 100, 1.0)
    sw.allotted([0] * (SWITCHED + 4))
    assert not sw.rates and sw.futile_at == SWITCHED + 4
    assert all(choices(sw, 4, 2 * PROBE_EVERY)) and all(choices(sw, SWITCHED - 1, 2 * PROBE_EVERY))
    assert choices(sw, SWITCHED + 4, PROBE_EVERY).count(True) == 1  # futile there: probes only
    for _ in range(5):
        sw.record(SWITCHED, True, 1, 10.0)
        sw.record(SWITCHED, False, 100, 1.0)
    assert choices(sw, SWITCHED, PROBE_EVERY).count(True) == 1  # plain measured faster: probes only


def test_the_faster_mode_per_batch_bucket_wins_and_the_other_is_probed():
    sw = DraftSwitch()
    assert all(choices(sw, 8, PROBE_EVERY - 1))  # nothing measured: propose
    for _ in range(5):
        sw.record(8, True, 8, 1.0)  # 8 tokens/s proposing
        sw.record(8, False, 16, 1.0)  # 16 tokens/s plain
    got = choices(sw, 8, 3 * PROBE_EVERY)  # steps PROBE_EVERY .. 4 PROBE_EVERY - 1
    assert [i for i, c in enumerate(got, start=PROBE_EVERY) if c] == [PROBE_EVERY * j for j in (1, 2, 3)]
    assert choices(sw, 16, 1) == [sw.steps % PROBE_EVERY != 0]  # another bucket: its own measurement (none yet)
    for _ in range(20):  # proposing turns faster: back to proposing, plain only probed
        sw.record(8, True, 40, 1.0)
    got = choices(sw, 8, PROBE_EVERY)
    assert got.count(False) == 1 and (sw.steps - PROBE_EVERY + 1 + got.index(False)) % PROBE_EVERY == 0


def test_an_empty_allotment_at_load_marks_proposing_futile_until_a_node_is_taken():
    sw = DraftSwitch()
    sw.allotted([0] * (FUTILE_BATCH - 1))
    assert sw.futile_at is None  # too few requests offered nodes
    sw.allotted([0] * (FUTILE_BATCH + 2))
    assert sw.futile_at == FUTILE_BATCH + 2
    assert choices(sw, FUTILE_BATCH + 1, 1) == [True]  # a smaller batch still proposes
    got = choices(sw, FUTILE_BATCH + 2, 2 * PROBE_EVERY)
    assert got.count(True) == 2  # probes only
    sw.allotted([0] * FUTILE_BATCH)
    assert sw.futile_at == FUTILE_BATCH
    sw.allotted([0, 2, 0, 0, 0])
    assert sw.futile_at is None
