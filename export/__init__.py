"""`python -m export ...`: a thin CLI over spork_trt.export."""
