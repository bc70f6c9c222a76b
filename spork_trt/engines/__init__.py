"""Engines run one model over new tokens against their own preallocated KV cache.

Interface (the torch engine is the reference; ONNX Runtime and TensorRT engines follow it):
  reset(max_len)                                   ready for a new sequence of at most max_len positions
  forward(input_ids [B,T], position_ids [B,T], mask [B,T,S]) -> logits [B,T,V]
                                                   S = length + pending + T; appends T pending KV rows
  commit(rows=None)                                keep pending rows (indices from `length`; None: all)
  truncate(length)                                 roll back to `length` committed rows
  length, pending                                  committed rows; rows written since the last commit
"""
