"""The draft head trains on a tiny random target's own text: the loss falls, held-out agreement beats the untrained
head, the saved head (safetensors) loads back, training resumes from its checkpoint, and the training-time-test mask
lets a depth-j node see exactly what it sees when drafting."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spork_trt.draft_head import load_head
from spork_trt.export.train_draft import TrainConfig, step_mask, train_draft
from spork_trt.weights import random_checkpoint
from tests.conftest import tiny_config, write_selfdata


@pytest.fixture(scope="module")
def target():
    return random_checkpoint(tiny_config(vocab_size=48, n_layers=3), seed=11, scale=8.0).model


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """A self-data folder: the target's greedy continuations of 160 random prompts."""
    return write_selfdata(target, tmp_path_factory.mktemp("selfdata"))


def test_step_mask_gives_each_depth_its_drafting_view():
    m = step_mask(3, 6, torch.ones(1, 6, dtype=torch.bool))[0]  # [T, 3T]
    p = 4  # a depth-3 node at position 4: its chain's root entry is at 2 (step 1), then step 2 at 3, itself
    assert m[p, :6].nonzero().flatten().tolist() == [0, 1, 2]
    assert m[p, 6:12].nonzero().flatten().tolist() == [3] and m[p, 12:].nonzero().flatten().tolist() == [4]
    one = step_mask(1, 4, torch.tensor([[True, True, True, False]]))[0]
    assert torch.equal(one[:3, :3], torch.tril(torch.ones(3, 3, dtype=torch.bool))) and not one[:3, 3].any()
    assert one[3, 3]  # a padding row still sees itself (no empty softmax)


def test_head_trains_saves_and_resumes(target, data, tmp_path):
    cfg = TrainConfig(data=data, out=tmp_path / "head", vocab=40, steps=2, epochs=4, lr=1e-2, batch=8, seed=1)
    first = train_draft(cfg, target)
    assert first["losses"][1] < first["losses"][0]
    before, after = first["evals"][0], first["evals"][-1]  # the untrained head, then after each epoch
    assert after["agreement"][0] > before["agreement"][0] + 0.1, first["evals"]
    assert after["accepted_length"] > before["accepted_length"], first["evals"]
    head, meta = load_head(tmp_path / "head" / "head.safetensors")
    assert meta["epoch"] == 4 and head.hc.vocab == 40 and head.d2t.shape == (40,)
    assert meta["heldout_sequences"] > 0 and meta["train_sequences"] + meta["heldout_sequences"] == 160
    more = train_draft(replace(cfg, epochs=5, resume=True), target)  # one more epoch from the checkpoint
    assert more["epoch"] == 5 and more["losses"][:4] == first["losses"] and len(more["evals"]) == 6


def test_feature_extraction_resumes_where_it_stopped(target, tmp_path):
    from spork_trt.export.train_draft import extract

    seqs = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    full = extract(target, seqs, (1, 3), tmp_path / "full")
    assert full.feats.shape == (12, 2 * target.cfg.dim) and list(full.offsets) == [0, 5, 8, 12]
    part = tmp_path / "part"
    extract(target, seqs, (1, 3), part)
    (part / "done").unlink()
    (part / "progress").write_text("1\n")  # as if interrupted after the first sequence
    import numpy as np

    f = np.load(part / "feats.npy", mmap_mode="r+")
    f[5:] = 0
    f.flush()
    again = extract(target, seqs, (1, 3), part)
    assert np.array_equal(np.asarray(again.feats), np.asarray(full.feats))
    assert np.array_equal(np.asarray(again.labels), np.asarray(full.labels))
