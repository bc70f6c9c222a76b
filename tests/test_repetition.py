"""Context repetition features of draft nodes, on hand-made contexts whose answers can be counted by eye."""
from __future__ import annotations

import math

import numpy as np
import pytest

from spork_trt.spec.repetition import MAX_MATCH, REPETITION, repetition, suffix_match
from spork_trt.spec.tree import DraftTree

COL = {name: i for i, name in enumerate(REPETITION)}


def test_suffix_match_counts_tokens_ending_at_each_position():
    ctx = np.array([1, 2, 3, 9, 2, 3, 7, 2, 3])  # ends with "2 3"
    assert suffix_match(ctx).tolist() == [0, 0, 2, 0, 0, 2, 0, 0]
    assert suffix_match(np.array([5] * 100)).max() == MAX_MATCH  # capped
    assert suffix_match(np.array([5])).shape == (0,)


def test_repetition_of_each_node_path():
    # prompt: "1 2 3 4 5"; generated: "8 2 3 4 6 2 3"; root = the last 3
    ctx = np.array([1, 2, 3, 4, 5, 8, 2, 3, 4, 6, 2, 3])
    # root 3 -> 4 (seen twice after "2 3") -> 5 (once, in the prompt) | 6 (once, generated); root -> 7 (never)
    tree = DraftTree((3, 4, 5, 6, 7), (-1, 0, 1, 1, 0))
    x = repetition(ctx, 5, tree, (0, 1, 2, 2, 1))
    assert x.shape == (5, len(REPETITION)) and not x[0].any() and not x[4].any()
    # node 1 "4": after "... 2 3" at positions 2 and 7; both match the context's end for 2 tokens ("2 3")
    assert x[1, COL["rep_len"]] == pytest.approx(math.log1p(2))
    assert x[1, COL["rep_dist"]] == pytest.approx(math.log1p(11 - 7))  # the latest of the longest
    assert x[1, COL["rep_in_prompt"]] == 0.0  # its copy of "4" is at 8, generated
    # both occurrences of "2 3" before the root (ending at 2 and 7) continue with 4
    assert x[1, COL["rep_prob"]] == 1.0 and x[1, COL["rep_count"]] == pytest.approx(math.log1p(2))
    # node 2 "5": "3 4 5" occurs once, at the prompt's 3 4 5, whose "2 3" matches the end for 2 tokens
    assert x[2, COL["rep_len"]] == pytest.approx(math.log1p(2)) and x[2, COL["rep_in_prompt"]] == 1.0
    assert x[2, COL["rep_prob"]] == 0.5  # "2 3 4" was followed by 5 once and by 6 once
    assert x[3, COL["rep_prob"]] == 0.5 and x[3, COL["rep_in_prompt"]] == 0.0
