"""The OpenAI-compatible front end: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health` over HTTP
(FastAPI + uvicorn), forwarding every request to the Triton server's `spork` model over gRPC streaming.

It sends token ids to `spork` (the engine core's own entry point) rather than text to `ensemble`: the ensemble's
preprocessing wraps its `text_input` in the chat template as ONE user message, so a conversation, a system prompt
or a raw completion prompt could not reach the model as written, its responses carry no token ids (usage would be
a guess), and Triton checks an ensemble's cancellation only between steps (a client that goes away would leave its
request running). Here the front end renders the conversation with the build's own tokenizer and chat template,
counts tokens exactly, detokenizes as postprocessing does, and cancels the stream when the client leaves or a stop
string ends the answer. Triton stays the server of record: batching, queueing, speculation and metrics are its.

Files: errors.py (OpenAI's error shape), model.py (the served model: tokenizer, context, prompt rendering),
params.py (a request body -> one validated Job), stops.py (stop strings over a stream), upstream.py (the gRPC
stream to `spork`), responses.py (OpenAI's response and chunk shapes), app.py (the routes), server.py (uvicorn in
a thread of `serve`).
"""
