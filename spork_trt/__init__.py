"""spork_trt: lossless tree speculative decoding for Llama-family LLMs, deployed with ONNX, TensorRT and Triton."""

__version__ = "0.1.0"
