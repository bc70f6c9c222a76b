"""Sampling transforms and the stop rule."""
from __future__ import annotations

import torch

from spork_trt.config import SamplingConfig
from spork_trt.spec.sampling import make_generator, pick, processed_probs
from spork_trt.loop.stopping import StopState


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    assert processed_probs(logits, SamplingConfig()).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = processed_probs(logits, SamplingConfig(temperature=1.0))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.05]]), atol=1e-6)
    p = processed_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = processed_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = processed_probs(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)
    hot = processed_probs(logits, SamplingConfig(temperature=0.5))
    assert hot[0, 0] > 0.5 and torch.allclose(hot.sum(), torch.tensor(1.0))


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    s = SamplingConfig(temperature=1.0, seed=7)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    g1, g2 = make_generator(7), make_generator(7)
    a = [pick(logits, s, g1) for _ in range(3000)]
    assert a == [pick(logits, s, g2) for _ in range(3000)]
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


def test_stop_rule_eos_max_and_stop_strings():
    st = StopState(frozenset({0}), max_new_tokens=10)
    assert st.add([5, 6, 0, 7]) == [5, 6] and st.reason == "eos" and st.tokens == [5, 6]
    st = StopState(frozenset({0}), max_new_tokens=3)
    assert st.add([5, 6]) == [5, 6] and st.reason is None
    assert st.add([7, 8]) == [7] and st.reason == "max_tokens"
    vocab = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
    decode = lambda ids: "".join(vocab[i] for i in ids)
    st = StopState(frozenset(), 50, ("o w",), decode)
    assert st.add([1, 2, 3, 4, 5]) == [1, 2, 3] and st.reason == "stop_string"
    assert st.text() == "Hell"


def test_a_stream_holds_back_only_the_tokens_that_could_begin_a_stop_string():
    vocab = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: " w"}
    decode = lambda ids: "".join(vocab[i] for i in ids)
    st = StopState(frozenset(), 50, ("o wor", "!!"), decode)
    assert st.add([1]) == [1] and st.held() == 0  # "Hel": nothing could begin a stop string
    st.add([2])
    assert st.held() == 1  # "...lo": "o" could begin "o wor", and it is in the last token
    st.add([3])
    assert st.held() == 2  # "...lo wo": from "o" on, two tokens
    st.add([4])
    assert st.reason == "stop_string" and st.held() == 0 and st.text() == "Hell"  # stopped: the final one sends all
    st = StopState(frozenset(), 50, ("o wor",), decode)
    st.add([1, 2, 6, 5])
    assert st.held() == 0  # "Hello w!": "o w" did not become a stop string
    assert StopState(frozenset(), 50).held() == 0


def test_cut_and_partial_stop():
    from spork_trt.loop.stopping import cut, partial_stop

    assert cut("a cat sat", ("sat", "cat")) == "a " and cut("dog", ("cat",)) == "dog" and cut("x", ()) == "x"
    assert partial_stop("the ca", ("cat",)) == 2 and partial_stop("the c", ("cat", "the c!")) == 5
    assert partial_stop("cat", ("cat",)) == 0 and partial_stop("abc", ()) == 0  # a whole stop string is not partial
