"""The decode rule, against a table written by hand from its definition (scheme.py): when the
token at position t attends, the quantized body holds positions [0, n_q(t)), the residual window
of R tokens is flushed F at a time, and the current token is always exact. Both forms of the rule
(the int one the cache's flushes use, the tensor one the simulator's masks use) must give the
table; a wrong boundary (t vs t + 1, floor vs ceil) changes at least one entry."""

import pytest
import torch

from kvcalib_runtime.cache.scheme import quantized_prefix, quantized_prefix_int

# (R, F): n_q(t) for t = 0, 1, ..., 12
TABLE = {
    (0, 1): [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # no window: all but the current token
    (4, 1): [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # KIVI's values: one token leaves at a time
    (4, 4): [0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12],  # KIVI's keys: R leave at once when R fill
    (6, 3): [0, 0, 0, 0, 0, 0, 3, 3, 3, 6, 6, 6, 9],
    (1, 1): [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # a window of one: only t itself exact
    (16, 2): [0] * 13,  # longer than the sequence: nothing quantized yet
}


@pytest.mark.parametrize(("residual", "flush"), list(TABLE))
def test_the_decode_rule_by_hand(residual, flush):
    expected = TABLE[residual, flush]
    ints = [quantized_prefix_int(t, residual, flush) for t in range(13)]
    tensor = quantized_prefix(torch.arange(13), residual, flush).tolist()
    assert ints == expected
    assert tensor == expected


def test_the_window_holds_between_r_minus_f_plus_one_and_r_tokens():
    for (residual, flush), row in TABLE.items():
        if residual == 0 or residual > 12:
            continue
        for t, n_q in enumerate(row):
            exact = t + 1 - n_q  # the window, the current token included
            if t + 1 >= residual:
                assert residual - flush + 1 <= exact <= residual, (residual, flush, t)
