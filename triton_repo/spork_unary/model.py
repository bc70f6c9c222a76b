"""Triton python model `spork_unary`: the unary entry point (ModelInfer over HTTP and gRPC, which Triton refuses for
an ensemble with a decoupled step). It loads no engine: each request goes to the decoupled `spork` model through a
BLS call, so both entry points share one engine core and one KV pool, and the request's final response is
returned. A thin adapter: the requests of a batch (the dynamic batcher's, which bounds the queue in front of it) are
sent to `spork` together and awaited concurrently, and several light instances serve batches at once.

Cancellation: Triton 2.51 cannot cancel a BLS request (python_backend has that from r25.05), so each request carries
a random cancel_key of its own (never a client's: this model's inputs have none); while it waits, its own
request's cancellation is polled (a gRPC client's cancel or deadline), and once it is cancelled a second request
carrying only the key cancels the first wherever it is served (cancel_board.py) and this request is answered
CANCELLED. Requests through `ensemble_unary` are not cancellable: Triton 2.51 checks an ensemble's cancellation only
between its steps, and this step's own request never sees it."""
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.cancel_board import new_key

STEP = io_spec.model_step("spork_unary")
OUTPUTS = [t.name for t in STEP.outputs]
CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "internal": "INTERNAL"}  # names in pb_utils.TritonError
POLL_S = 0.2  # how often a waiting request's cancellation is checked


def key_tensor(key: str):
    return pb_utils.Tensor(io_spec.CANCEL_KEY.name, np.array([[key.encode()]], np.object_))  # [1, 1]


def spork_call(inputs):
    """The BLS call to `spork`: awaitable, it resolves at spork's first response (python_backend's iterator holds
    it), so a unary request's whole wait is this future's."""
    call = pb_utils.InferenceRequest(model_name="spork", inputs=inputs, requested_output_names=OUTPUTS)
    return asyncio.ensure_future(call.async_exec(decoupled=True))


class TritonPythonModel:
    async def execute(self, requests):
        return list(await asyncio.gather(*(self.answer(r) for r in requests)))

    @staticmethod
    async def answer(request):
        stream = pb_utils.get_input_tensor_by_name(request, "stream")
        if stream is not None and bool(stream.as_numpy().reshape(-1)[0]):
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "stream=true needs the streaming model `ensemble`; `ensemble_unary` answers once",
                pb_utils.TritonError.INVALID_ARG))
        key = new_key()
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, s.name) for s in STEP.inputs)
                  if t is not None]
        pending = spork_call([*inputs, key_tensor(key)])
        while not (await asyncio.wait({pending}, timeout=POLL_S))[0]:
            if request.is_cancelled():
                return await TritonPythonModel.cancel(key, pending)
        last = None
        for r in pending.result():  # one response with the outputs, then (maybe) an empty final flag
            if r.has_error():  # its code is lost in the BLS call: found again from the message (io_spec.error_kind)
                message = r.error().message()
                code = getattr(pb_utils.TritonError, CODES[io_spec.error_kind(message)])
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
            if r.output_tensors():
                last = r
        if last is None:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("spork sent no response"))
        return pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(last, n) for n in OUTPUTS])

    @staticmethod
    async def cancel(key, pending):
        """The client cancelled: spork ends the request carrying `key` at its next step (and closes it: `pending`
        resolves then, unread); answered CANCELLED."""
        pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it: no warning either
        for r in await spork_call([key_tensor(key)]):
            if r.has_error():
                pb_utils.Logger.log_error(f"spork_unary: cancelling a request failed: {r.error().message()}")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError("the request was cancelled",
                                                                     pb_utils.TritonError.CANCELLED))
