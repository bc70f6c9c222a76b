"""The decoding loop: the runtime, the engine core that steps every request together, requests, admission, prefix reuse,
stop rules, statistics."""
