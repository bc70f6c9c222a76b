"""Checkpoints: weights (GGUF, Hugging Face), their blocks, the tokenizer, the reference transformer, a build's
manifest."""
