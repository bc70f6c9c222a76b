"""Triton python model `spork_unary`: the unary entry point (ModelInfer over HTTP and gRPC, which Triton refuses for
an ensemble with a decoupled step). It loads no engine: each request goes to the decoupled `spork` model through a
BLS call, so both entry points share one engine core and one KV pool, and the request's final response is
returned. A thin adapter: the requests of a batch (the dynamic batcher's, which bounds the queue in front of it) are
sent to `spork` together and awaited concurrently, and several light instances serve batches at once."""
import asyncio

import triton_python_backend_utils as pb_utils

from spork_trt import io_spec

STEP = next(s for s in io_spec.TRITON_STEPS if s.name == "spork")
OUTPUTS = [t.name for t in STEP.outputs]
CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "internal": "INTERNAL"}  # names in pb_utils.TritonError


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
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, s.name) for s in STEP.inputs)
                  if t is not None]
        call = pb_utils.InferenceRequest(model_name="spork", inputs=inputs, requested_output_names=OUTPUTS)
        last = None
        for r in await call.async_exec(decoupled=True):  # one response with the outputs, then (maybe) an empty final flag
            if r.has_error():  # its code is lost in the BLS call: found again from the message (io_spec.error_kind)
                message = r.error().message()
                code = getattr(pb_utils.TritonError, CODES[io_spec.error_kind(message)])
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
            if r.output_tensors():
                last = r
        if last is None:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError("spork sent no response"))
        return pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(last, n) for n in OUTPUTS])
