"""Triton python model `postprocessing`: the spork step's token ids -> the text this response adds.
Stateless (every response carries the ids so far and how many were sent before), so a stream never splits a
multi-byte character. A thin adapter: the logic is spork_trt.service.decode_chunk (tested without Triton)."""
import triton_python_backend_utils as pb_utils

from spork_trt.service import decode_chunk, model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tok = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            ids, sent, final = (pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                                for n in ("output_ids", "sent_len", "final"))
            text = decode_chunk(self.tok, ids, sent, final)  # [1, 1] bytes
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
