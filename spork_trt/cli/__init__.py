"""The command line: `python -m spork_trt generate|chat|serve|client|demo` (the top layer)."""
