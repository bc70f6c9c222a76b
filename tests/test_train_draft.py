"""The draft head trains on a tiny random target's own text: the loss falls, held-out agreement beats the untrained
head, the saved head (safetensors) loads back, training resumes from its checkpoint, and the training-time-test mask
lets a depth-j node see exactly what it sees when drafting."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spork_trt.spec.draft_head import load_head
from spork_trt.errors import UserError
from spork_trt.learn.train_draft import TrainConfig, train_draft
from spork_trt.learn.unroll import step_mask
from spork_trt.checkpoint.weights import random_checkpoint
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
    assert meta["epoch"] == 4 and head.hc.vocab == 40 and head.d2t.shape == (40,) and meta["labels"] == "soft"
    assert meta["heldout_sequences"] > 0 and meta["train_sequences"] + meta["heldout_sequences"] == 160
    more = train_draft(replace(cfg, epochs=5, resume=True), target)  # one more epoch from the checkpoint
    assert more["epoch"] == 5 and more["losses"][:4] == first["losses"] and len(more["evals"]) == 6


def test_feature_extraction_resumes_where_it_stopped(target, tmp_path):
    from spork_trt.learn.head_data import extract

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
    padded = extract(target, seqs, (1, 3), tmp_path / "batched", batch=2)  # as on a GPU: right-padded batches
    assert np.allclose(np.asarray(padded.feats, np.float32), np.asarray(full.feats, np.float32), atol=2e-3)
    assert np.array_equal(np.asarray(padded.labels), np.asarray(full.labels))


def test_agreement_on_unseen_answers_scores_as_training_scores_its_held_out_text(target, data, tmp_path):
    """`bench agreement --head` on the held-out sequences reproduces train-draft's held-out evaluation exactly: the
    same answer tokens scored, the same draft vocabulary, the same depths."""
    import json

    from bench.head_agreement import head_rows
    from spork_trt.learn.head_data import heldout

    meta = train_draft(TrainConfig(data=data, out=tmp_path / "head", vocab=40, steps=3, epochs=1, lr=1e-2, seed=2),
                       target)
    rows = [json.loads(line) for line in (data / "answers.jsonl").read_text().splitlines()]
    refs = {"heldout": [(r["ids"][:r["n_prompt"]], r["ids"][r["n_prompt"]:]) for r in rows if heldout(r["id"])]}
    [row] = head_rows(str(tmp_path / "head"), {"sha256": "x", "path": None}, refs, target)
    assert row["tokens"] == meta["heldout"]["tokens"] > 0
    assert row["agreement"] == pytest.approx(meta["heldout"]["agreement"], abs=1e-6)
    assert len(row["agreement"]) == 3 and row["accepted_length"] == pytest.approx(meta["heldout"]["accepted_length"])
    buckets = row["by_confidence"]  # depth-1 agreement by the target's own confidence: the same split of the same hits
    assert [b["share"] for b in buckets] == pytest.approx([b["share"] for b in meta["heldout"]["by_confidence"]])
    assert sum(b["share"] for b in buckets) == pytest.approx(1.0)
    assert sum(b["share"] * b["agreement"] for b in buckets) == pytest.approx(row["agreement"][0], abs=1e-6)


def test_a_packed_corpus_gives_the_sequences_and_answer_starts_of_its_self_data(tmp_path):
    import json

    import numpy as np

    from spork_trt.spec.datastore import join
    from spork_trt.export import artifacts

    g = np.random.default_rng(0)
    header = [90, 91, 92]  # the chat template's assistant-turn opening; never inside an answer
    rows = []
    for i in range(12):
        prompt = [90, 91, 5] + g.integers(0, 80, 4 + i).tolist() + header  # an earlier, different turn opening
        rows.append({"id": f"seq-{i}", "ids": prompt + g.integers(0, 80, 10).tolist(), "n_prompt": len(prompt)})
    d = tmp_path / "packed"
    d.mkdir()
    np.savez_compressed(d / artifacts.CORPUS, tokens=join(r["ids"] for r in rows))
    (d / artifacts.MANIFEST).write_text(json.dumps({"recipe": {"seed": 7}}))
    got, recipe = artifacts.training_rows(d, header)
    assert got == rows and recipe == {"seed": 7}
    with pytest.raises(UserError, match="neither a self-data folder"):
        artifacts.training_rows(tmp_path, header)


def test_the_head_normalises_its_features_as_the_target_normalises_its_last_hidden_state(target):
    """A last-layer tap enters fc as the target's post-norm hidden state (EAGLE-1's features): its raw residual
    stream has outlier channels that drown the token's embedding. --no-feature-norm keeps the older head."""
    from spork_trt.spec.draft_head import DraftHead, HeadConfig

    last = (target.cfg.n_layers,)
    head = DraftHead(HeadConfig.for_target(target.cfg, last, 40))
    head.init_from_target(target, torch.arange(40))
    x = torch.randn(1, 5, target.cfg.dim) * 50
    assert torch.allclose(head.gnorm(x), target.norm(x))
    old = DraftHead(HeadConfig.for_target(target.cfg, last, 40, feature_norm=False))
    assert old.gnorm is None and "gnorm.weight" not in old.state_dict()


def test_soft_labels_are_the_targets_own_next_token_distribution(target, data, tmp_path):
    """--loss soft trains against the target's whole distribution over the draft vocabulary, recomputed from the
    cached last-layer feature: it is the target's softmax, its argmax the cached top-1 label. --loss hard still
    trains; soft needs the last layer tapped last."""
    import numpy as np

    from spork_trt.learn.head_data import extract
    from spork_trt.learn.unroll import Teacher
    from spork_trt.checkpoint.transformer import causal_mask

    seq = [3, 9, 14, 2, 30, 7]
    f = extract(target, [seq], (1, target.cfg.n_layers), tmp_path / "feats")
    v = target.cfg.vocab_size
    last = torch.from_numpy(np.asarray(f.feats, np.float32))[None, :, -target.cfg.dim:]  # [1, T, C]
    soft = Teacher(target, torch.arange(v))(last)
    with torch.no_grad():
        logits = target(torch.tensor([seq]), torch.arange(6)[None], causal_mask(0, 6)).logits  # [1, T, V]
    assert torch.allclose(soft, torch.softmax(logits, -1), atol=2e-3)
    assert soft.argmax(-1)[0].tolist() == np.asarray(f.labels).tolist()
    cfg = TrainConfig(data=data, out=tmp_path / "hard", vocab=40, steps=2, epochs=2, lr=1e-2, seed=1, loss="hard")
    hard = train_draft(cfg, target)
    assert hard["labels"] == "hard" and hard["losses"][1] < hard["losses"][0]
    assert hard["evals"][-1]["agreement"][0] > hard["evals"][0]["agreement"][0] + 0.1
    with pytest.raises(UserError, match="--loss soft"):
        train_draft(replace(cfg, taps=(1,), loss="soft"), target)
