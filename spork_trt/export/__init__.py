"""Export: our reference model -> ONNX graphs (+ quantized variants) -> engines/<name>/ with a manifest."""
