"""The build: our reference model -> ONNX graphs (+ quantized variants, TensorRT plans) -> engines/<name>/ with a
manifest (spork_trt/checkpoint/manifest.py). It compiles and never runs the product: no import of the runtime, the service or the
learners (spork_trt/learn/, which may import the build)."""
