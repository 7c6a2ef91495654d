"""``Grown``: a running request's read-only window on a list that only grows (kvtier/outputs.py)."""

from __future__ import annotations

import copy
import pickle

import pytest

from kvtier.outputs import Grown


def test_a_window_reads_like_the_list_it_showed_however_the_list_grows() -> None:
    tokens = [7, 8, 9, 10, 11]
    window = Grown(tokens, 2)  # the output tokens of a 2-token prompt
    tokens += [12, 13]  # later steps
    assert len(window) == 3 and list(window) == [9, 10, 11]
    assert window == [9, 10, 11] and window == (9, 10, 11) and [9, 10, 11] == window  # noqa: SIM300
    assert window != [9, 10, 11, 12] and window != [9, 10] and window != "abc"
    assert (window[0], window[-1], window[-3]) == (9, 11, 9)
    assert window[1:] == [10, 11] and window[::-1] == [11, 10, 9] and window[5:] == []
    assert isinstance(window[1:], list)
    for bad in (3, -4):
        with pytest.raises(IndexError):
            window[bad]
    assert repr(window) == "[9, 10, 11]" and 10 in window and window.index(11) == 2
    assert window == Grown(tokens, 2, 5) and window != Grown(tokens, 2)
    assert pickle.loads(pickle.dumps(window)) == [9, 10, 11]
    assert type(copy.deepcopy(window)) is list and copy.deepcopy(window) == [9, 10, 11]
    with pytest.raises(TypeError):
        hash(window)
