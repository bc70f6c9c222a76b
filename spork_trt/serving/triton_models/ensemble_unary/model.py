"""Triton python model `ensemble_unary`: the ensemble's tensors answered once (text in, text out; ModelInfer over
HTTP and gRPC, which Triton refuses for the decoupled `ensemble`). It makes the ensemble's three calls itself,
through BLS: `preprocessing` (text -> ids), `spork` (answered once; it loads no engine, so every entry point shares
one engine core and one KV pool), `postprocessing` (ids -> text). The same models answer as in `ensemble`, so the
text is the same. Unlike an ensemble (whose cancellation Triton 2.51 checks only between steps) it is cancellable: a
gRPC client's cancel reaches the engine core through a cancel key (spork_trt.serving.triton_unary, shared with
`spork_unary`). A thin adapter: the requests of a batch (the dynamic batcher's, which bounds the queue in front of
it) are answered concurrently, and several light instances serve batches at once."""
import asyncio

import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.serving import triton_unary

PROMPT = [t.name for t in io_spec.model_step("preprocessing").inputs]  # text_input
IDS = [t.name for t in io_spec.model_step("preprocessing").outputs]  # input_ids: preprocessing -> spork
PARAMS = [t.name for t in io_spec.REQUEST_PARAMS]  # the client's, straight to spork
DECODE = [t.name for t in io_spec.model_step("postprocessing").inputs]  # spork -> postprocessing
TEXT = [t.name for t in io_spec.model_step("postprocessing").outputs]  # text_output
STATS = [t.name for t in io_spec.STATS_OUTPUTS]  # spork's, straight to the client


class TritonPythonModel:
    async def execute(self, requests):
        return list(await asyncio.gather(*(self.answer(r) for r in requests)))

    @staticmethod
    async def answer(request):
        prompt = triton_unary.inputs(request, PROMPT)
        if not prompt:  # no python model takes a request without inputs (python_backend 24.10: "request has 0
            # inputs"), so preprocessing's answer to it is given here
            return triton_unary.refusal(io_spec.TEXT_MISSING, "INVALID_ARG")
        ids = await triton_unary.step("preprocessing", prompt)
        if ids.has_error():
            return ids
        spork = await triton_unary.spork_once(request, triton_unary.outputs(ids, IDS)
                                              + triton_unary.inputs(request, PARAMS))
        if spork.has_error():
            return spork
        text = await triton_unary.step("postprocessing", triton_unary.outputs(spork, DECODE))
        if text.has_error():
            return text
        return pb_utils.InferenceResponse(triton_unary.outputs(text, TEXT) + triton_unary.outputs(spork, STATS))
