"""What learns from the runtime: the target's own text (selfdata.py), the learned draft head (train_draft.py over
head_data.py, unroll.py, head_eval.py; convert_head.py for a trained EAGLE checkpoint) and the verifier's confidence
heads (calibrate.py). Learners run the product (spork_trt.loop.runtime) and read builds; the build never imports them."""
