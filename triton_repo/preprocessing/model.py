"""Triton python model `preprocessing`: text_input -> input_ids through the chat template.
A thin adapter: the logic is spork_trt.service.encode_text (tested without Triton)."""
import json

import triton_python_backend_utils as pb_utils

from spork_trt.errors import UserError
from spork_trt.service import encode_text, engines_dir, load_tokenizer_from_engines


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tok = load_tokenizer_from_engines(engines_dir(args["model_repository"], params["engines"]["string_value"]))

    def execute(self, requests):
        responses = []
        for request in requests:  # each request gets its own response, or its own error
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()  # [1, 1] bytes
                ids = encode_text(self.tok, text)  # [1, n]
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
            except UserError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
        return responses
