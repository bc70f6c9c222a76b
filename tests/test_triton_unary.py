"""triton_unary.spork_once (the unary models' call to `spork`) against a stand-in for python_backend's module: a
BLS stream that ends with neither outputs nor an error is asked once more (python_backend 24.10 lost about one
response in 400 under load in bench soak), never for a cancelled request, and twice empty is an INTERNAL error."""
from __future__ import annotations

import asyncio
import sys
import types

import numpy as np
import pytest


class Response:
    def __init__(self, outputs=(), error=None):
        self.outputs, self.err = list(outputs), error

    def has_error(self):
        return self.err is not None

    def error(self):
        return self.err

    def output_tensors(self):
        return self.outputs


class Error:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

    def __init__(self, message, code=None):
        self.text, self.code = message, code

    def message(self):
        return self.text


class Tensor:
    def __init__(self, name, array):
        self._name, self.array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self.array


@pytest.fixture
def unary(monkeypatch):
    """triton_unary over a fake pb_utils whose BLS calls answer from `streams` (one list of responses per call)."""
    streams, calls, warnings = [], [], []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model, self.inputs = model_name, inputs

        async def async_exec(self, decoupled=False):
            calls.append([t.name() for t in self.inputs])
            return iter(streams.pop(0))

    fake = types.ModuleType("triton_python_backend_utils")
    fake.InferenceRequest, fake.Tensor, fake.TritonError = InferenceRequest, Tensor, Error
    fake.InferenceResponse = lambda error=None, **kw: Response(error=error)
    fake.Logger = types.SimpleNamespace(log_warn=warnings.append, log_error=warnings.append)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "spork_trt.serving.triton_unary", raising=False)
    import spork_trt.serving.triton_unary as unary

    unary.streams, unary.calls, unary.warnings = streams, calls, warnings
    return unary


class Request:
    def __init__(self, cancelled=False):
        self.cancelled = cancelled

    def is_cancelled(self):
        return self.cancelled


def answer(unary, request):
    inputs = [Tensor("input_ids", np.array([[1, 2]], np.int32))]
    return asyncio.run(unary.spork_once(request, inputs))


def test_an_empty_stream_is_asked_once_more(unary):
    good = Response(outputs=["output_ids"])
    unary.streams.extend([[Response()], [good, Response()]])
    assert answer(unary, Request()) is good
    assert len(unary.calls) == 2 and len(unary.warnings) == 1
    assert all(c == ["input_ids", "cancel_key"] for c in unary.calls)  # a new key each time


def test_twice_empty_is_an_internal_error_and_a_cancelled_request_is_not_asked_again(unary):
    unary.streams.extend([[Response()], [Response()]])
    r = answer(unary, Request())
    assert r.err.code == "INTERNAL" and "no response" in r.err.message()
    unary.streams.extend([[Response()]])
    r = answer(unary, Request(cancelled=True))
    assert r.err.code == "CANCELLED" and len(unary.calls) == 3


def test_an_error_is_relayed_with_its_code_not_retried(unary):
    unary.streams.extend([[Response(error=Error("prompt too long: max_tokens ..."))]])
    r = answer(unary, Request())
    assert r.has_error() and len(unary.calls) == 1


def test_a_cancelled_request_reads_its_stream_to_its_end(unary, monkeypatch):
    """Cancelled while spork runs it: the cancel call carries the request's key alone, spork then closes the request's
    stream, and that stream is read to its end (left unread, it kept spork_unary from ever unloading: Triton's
    exit timeout on every stop after a cancel); the client is answered CANCELLED."""
    read = []
    cancelled = asyncio.Event()

    def stream():
        yield Response()  # spork's empty final response for a request it ended
        read.append("end")

    async def async_exec(self, decoupled=False):
        names = [t.name() for t in self.inputs]
        unary.calls.append(names)
        if names == ["cancel_key"]:
            cancelled.set()
            return iter([])
        await cancelled.wait()
        return stream()

    monkeypatch.setattr(unary.pb_utils.InferenceRequest, "async_exec", async_exec)
    monkeypatch.setattr(unary, "POLL_S", 0.01)
    r = answer(unary, Request(cancelled=True))
    assert r.err.code == "CANCELLED" and unary.calls == [["input_ids", "cancel_key"], ["cancel_key"]]
    assert read == ["end"] and unary.warnings == []
