"""Cancels by key without Triton: the board every instance reads (a posted key is seen, taken off, swept when old),
cancel_key's validation at the edge, and a Service that ends the request carrying a cancelled key at its next step
and forgets the key."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from spork_trt.serving.cancel_board import CancelBoard, new_key
from spork_trt.errors import UserError
from spork_trt.serving.request_tensors import Limits, is_cancel, parse_request

IDS = np.array([[5, 6, 7, 8]], np.int32)  # [1, n]


def key_input(key) -> np.ndarray:
    return np.array([[key if isinstance(key, bytes) else key.encode()]], np.object_)  # [1, 1]


def test_a_posted_key_is_seen_by_every_board_on_the_folder_until_taken_off(tmp_path):
    mine, other = CancelBoard(tmp_path / "board"), CancelBoard(tmp_path / "board")  # two instances
    a, b = new_key(), new_key()
    assert a != b and len(a) == 32 and not mine.posted(a)  # no folder yet: nothing posted
    other.post(a)
    assert mine.posted(a) and not mine.posted(b)
    assert (tmp_path / "board").stat().st_mode & 0o777 == 0o700  # the user's own
    mine.clear(a)
    mine.clear(b)  # a key never posted: nothing to do
    assert not other.posted(a)


def test_old_keys_are_swept_when_another_is_posted(tmp_path):
    board = CancelBoard(tmp_path, max_age_s=60)
    old, fresh = new_key(), new_key()
    board.post(old)
    os.utime(tmp_path / old, (time.time() - 61, time.time() - 61))
    board.post(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh]


def test_a_full_board_refuses_more_cancels_until_keys_leave(tmp_path):
    from spork_trt.errors import QueueFull

    board = CancelBoard(tmp_path, max_keys=2)
    a, b, c = new_key(), new_key(), new_key()
    board.post(a)
    board.post(b)
    with pytest.raises(QueueFull, match="retry later"):
        board.post(c)
    assert not board.posted(c)
    board.clear(a)  # its request ended
    board.post(c)
    assert board.posted(c)


def test_made_up_keys_cannot_keep_a_running_request_from_being_cancelled(tmp_path):
    """A flood of cancels for keys no request carries fills only their own share of the board: the cancel of a
    running request is still taken, and taking that request off clears its marks."""
    from spork_trt.errors import QueueFull

    board, serving = CancelBoard(tmp_path, max_keys=2), CancelBoard(tmp_path, max_keys=2)  # two instances
    mine = new_key()
    serving.serving(mine)
    board.post(new_key())
    board.post(new_key())
    with pytest.raises(QueueFull):
        board.post(new_key())  # a third made-up key
    board.post(mine)  # full of made-up keys, yet the running request's cancel is taken
    assert serving.posted(mine) and board.running(mine)
    serving.clear(mine)
    assert not board.posted(mine) and not board.running(mine)
    with pytest.raises(QueueFull):
        board.post(mine)  # no longer running: it waits with the made-up keys, and there is no room


def test_running_marks_of_a_dead_instance_are_swept(tmp_path):
    board = CancelBoard(tmp_path, max_run_s=3600)
    key = new_key()
    board.serving(key)
    old = time.time() - 3601
    os.utime(tmp_path / "run" / key, (old, old))
    board.sweep()
    assert not board.running(key)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "A" * 32, "0" * 31, "0" * 33, "g" * 32, ""])
def test_the_board_takes_keys_only(tmp_path, bad):
    with pytest.raises(ValueError):
        CancelBoard(tmp_path).post(bad)


@pytest.mark.parametrize("bad", [b"../../etc/passwd", b"ABCDEF" + b"0" * 26, b"0" * 31, b"\xff" * 32, b""])
def test_a_bad_cancel_key_is_refused_naming_it(bad):
    with pytest.raises(UserError, match="^cancel_key must be 32 lowercase hex digits"):
        parse_request({"input_ids": IDS, "cancel_key": key_input(bad)}, Limits(64, vocab_size=96))


def test_a_cancel_is_a_key_without_input_ids():
    key = new_key()
    assert parse_request({"input_ids": IDS, "cancel_key": key_input(key)}, Limits(64, vocab_size=96)).cancel_key == key
    assert is_cancel({"input_ids": None, "cancel_key": key_input(key)})
    assert not is_cancel({"input_ids": IDS, "cancel_key": key_input(key)}) and not is_cancel({"input_ids": None})
    with pytest.raises(UserError, match="^input_ids is missing"):
        parse_request({"input_ids": None}, Limits(64, vocab_size=96))


@pytest.fixture(scope="module")
def service(default_runtime, tmp_path_factory):
    from spork_trt.config import SpecConfig
    from spork_trt.serving.engine_service import Service

    s = Service(default_runtime, SpecConfig.for_draft("ngram"), board=CancelBoard(tmp_path_factory.mktemp("board")))
    yield s
    s.close()


@pytest.mark.slow
def test_a_cancel_ends_the_request_carrying_its_key_and_the_key_is_forgotten(service, default_tokenizer):
    prompt = default_tokenizer.encode_prompt("Write a long story about a dragon.")
    key, stranger, chunks = new_key(), new_key(), []

    def send(chunk):
        chunks.append(chunk)
        if len(chunks) == 2:  # what spork does with spork_unary's cancel: maybe on another instance (one board)
            assert service.board.running(key)  # marked running: its cancel is taken however full the board is
            assert service.control({"input_ids": None, "cancel_key": key_input(key)})

    assert service.control({"cancel_key": key_input(stranger)})  # no request carries it: nothing happens
    inputs = {"input_ids": np.array([prompt], np.int32), "max_tokens": np.array([[200]], np.int32),
              "stream": np.array([[True]]), "cancel_key": key_input(key)}
    assert not service.run(inputs, send)  # cancelled: closed, nothing more sent
    assert len(chunks) == 2 and not chunks[-1].final and service.active == 0
    assert not service.board.posted(key) and not service.board.running(key)  # the request ended: its key with it
    assert service.board.posted(stranger)  # a cancel nobody took: swept once old
    assert not service.control({"input_ids": np.array([prompt], np.int32), "cancel_key": key_input(key)})  # a request
