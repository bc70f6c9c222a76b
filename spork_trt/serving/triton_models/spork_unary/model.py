"""Triton python model `spork_unary`: the spork step answered once (token ids in; ModelInfer over HTTP and gRPC,
which Triton refuses for an ensemble with a decoupled step). It loads no engine: each request goes to the decoupled
`spork` model through a BLS call, so every entry point shares one engine core and one KV pool, and the request's
final response is returned. Cancellable: a gRPC client's cancel reaches the engine core through a cancel key
(spork_trt.serving.triton_unary, shared with `ensemble_unary`). A thin adapter: the requests of a batch (the dynamic
batcher's, which bounds the queue in front of it) are sent to `spork` together and awaited concurrently, and several
light instances serve batches at once."""
import asyncio

import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.serving import triton_unary

STEP = io_spec.model_step("spork_unary")
INPUTS, OUTPUTS = [t.name for t in STEP.inputs], [t.name for t in STEP.outputs]


class TritonPythonModel:
    async def execute(self, requests):
        return list(await asyncio.gather(*(self.answer(r) for r in requests)))

    @staticmethod
    async def answer(request):
        r = await triton_unary.spork_once(request, triton_unary.inputs(request, INPUTS))
        return r if r.has_error() else pb_utils.InferenceResponse(triton_unary.outputs(r, OUTPUTS))
