"""The calls the unary python models (`spork_unary`: token ids in; `ensemble_unary`: text in) make through BLS, in
one place: the steps `preprocessing` and `postprocessing` (one response each), and `spork` answered once and
cancellable. Runs inside Triton's python backend only (it imports triton_python_backend_utils).

Cancellation: Triton 2.51 cannot cancel a BLS request (python_backend has that from r25.05), so each request to
`spork` carries a random cancel_key of its own (never a client's: neither model takes one); while it waits, the
caller's own request's cancellation is polled (a gRPC client's cancel or deadline), and once it is cancelled a second
request carrying only the key cancels the first wherever it is served (cancel_board.py) and the caller's request is
answered CANCELLED.

Errors: a BLS call receives every error as INTERNAL (Triton 2.51); its code is found again from the message
(io_spec.error_kind), so a bad field stays INVALID_ARG (HTTP 400) and a full queue UNAVAILABLE (503)."""
from __future__ import annotations

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.serving.cancel_board import new_key

SPORK_OUTPUTS = [t.name for t in io_spec.model_step("spork_unary").outputs]  # spork's, less its stream's logprobs
CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "internal": "INTERNAL"}  # names in pb_utils.TritonError
POLL_S = 0.2  # how often a waiting request's cancellation is checked
DRAIN_S = 10.0  # how long a cancelled request's spork stream may take to end (spork ends it at its next step)


def refusal(message: str, code: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


def relayed(response):
    """A BLS response's error, answered with the code its message says (io_spec.error_kind)."""
    message = response.error().message()
    return refusal(message, CODES[io_spec.error_kind(message)])


async def step(model: str, inputs: list):
    """One step's single response (`preprocessing`, `postprocessing`); an error one with its code found again."""
    names = [t.name for t in io_spec.model_step(model).outputs]
    r = await pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=names).async_exec()
    return relayed(r) if r.has_error() else r


def key_tensor(key: str):
    return pb_utils.Tensor(io_spec.CANCEL_KEY.name, np.array([[key.encode()]], np.object_))  # [1, 1]


def spork_call(inputs: list):
    """The BLS call to `spork`: awaitable, it resolves at spork's first response (python_backend's iterator holds
    it), so a unary request's whole wait is this future's."""
    call = pb_utils.InferenceRequest(model_name="spork", inputs=inputs, requested_output_names=SPORK_OUTPUTS)
    return asyncio.ensure_future(call.async_exec(decoupled=True))


async def spork_once(request, inputs: list):
    """`spork`'s answer to `inputs` (its tensors, without cancel_key), for the caller's `request`: spork's response
    with the outputs, or an error response (CANCELLED once `request` is cancelled). A BLS stream that ends with
    neither outputs nor an error (seen about once in 400 requests under load with python_backend 24.10, while spork
    had not cancelled the request) is asked once more: a request's answer does not depend on when it runs."""
    stream = next((t for t in inputs if t.name() == "stream"), None)
    if stream is not None and bool(stream.as_numpy().reshape(-1)[0]):
        return refusal("stream=true needs the streaming model `ensemble`; `ensemble_unary` answers once",
                       "INVALID_ARG")
    for attempt in range(2):
        answer = await spork_answer(request, inputs)
        if answer is not None:
            return answer
        if request.is_cancelled():
            return refusal("the request was cancelled", "CANCELLED")
        pb_utils.Logger.log_warn(f"spork's stream ended with no response (attempt {attempt + 1} of 2)")
    return refusal("spork sent no response", "INTERNAL")


async def spork_answer(request, inputs: list):
    """One call of spork_once's: the response or an error one, None when the stream ended with neither."""
    key = new_key()
    pending = spork_call([*inputs, key_tensor(key)])
    while not (await asyncio.wait({pending}, timeout=POLL_S))[0]:
        if request.is_cancelled():
            return await cancel(key, pending)
    last = None
    for r in pending.result():  # one response with the outputs, then (maybe) an empty final flag
        if r.has_error():
            return relayed(r)
        if r.output_tensors():
            last = r
    return last


async def cancel(key: str, pending):
    """The client cancelled: spork ends the request carrying `key` at its next step and closes its stream, which is
    read to its end (left unread, it kept `spork_unary` from ever unloading: `serve`'s stop then waited out
    Triton's exit timeout after any cancel); answered CANCELLED."""
    for r in await spork_call([key_tensor(key)]):
        if r.has_error():
            pb_utils.Logger.log_error(f"cancelling a request failed: {r.error().message()}")
    try:  # spork closes it at its next step; unread, its BLS stream kept this model from unloading (Triton 2.51)
        for _ in await asyncio.wait_for(pending, DRAIN_S):
            pass
    except Exception as e:  # noqa: BLE001 - the client is answered CANCELLED whatever the stream's end was
        pb_utils.Logger.log_warn(f"a cancelled request's spork stream did not end cleanly: {e!r}")
    return refusal("the request was cancelled", "CANCELLED")


def inputs(request, names) -> list:
    """The tensors `names` of a request, absent optional ones left out."""
    return [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in names) if t is not None]


def outputs(response, names) -> list:
    """The tensors `names` of a BLS response."""
    return [pb_utils.get_output_tensor_by_name(response, n) for n in names]
