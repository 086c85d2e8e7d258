"""EpochSampler: deterministic epochs without repeats, and an exact restore from its state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlhf_orch.data.sampler import EpochSampler


def test_no_repeats_within_an_epoch():
    s = EpochSampler(10, seed=3)
    first = s.take(10)
    assert sorted(first) == list(range(10))
    second = s.take(10)
    assert sorted(second) == list(range(10))
    assert first != second  # a new permutation each epoch


def test_permutation_is_numpy_default_rng_of_seed_and_epoch():
    s = EpochSampler(7, seed=11)
    got = s.take(14)
    want = list(np.random.default_rng([11, 0]).permutation(7)) + list(np.random.default_rng([11, 1]).permutation(7))
    assert got == [int(x) for x in want]


def test_deterministic_for_a_seed_and_seeds_differ():
    a = EpochSampler(50, seed=1).take(120)
    b = EpochSampler(50, seed=1).take(120)
    c = EpochSampler(50, seed=2).take(120)
    assert a == b
    assert a != c


def test_crossing_epochs_in_small_and_large_steps():
    whole = EpochSampler(5, seed=0).take(23)  # several epochs in one call
    stepped = EpochSampler(5, seed=0)
    pieces = []
    for n in (3, 4, 1, 0, 7, 8):
        pieces += stepped.take(n)
    assert pieces == whole
    assert stepped.epoch == 4 and stepped.consumed == 23
    for e in range(4):
        assert sorted(whole[5 * e : 5 * e + 5]) == list(range(5))


def test_state_dict_round_trip_gives_the_same_continuation():
    s = EpochSampler(9, seed=5)
    s.take(13)
    state = json.loads(json.dumps(s.state_dict()))  # plain JSON
    assert state == {"consumed": 13}
    expected = s.take(20)
    restored = EpochSampler(9, seed=5)
    restored.load_state_dict(state)
    assert restored.epoch == 1
    assert restored.take(20) == expected


def test_shuffle_false_is_file_order():
    s = EpochSampler(4, seed=99, shuffle=False)
    assert s.take(10) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("bad", [0, -3])
def test_num_items_must_be_positive(bad):
    with pytest.raises(ValueError):
        EpochSampler(bad, seed=0)


def test_bad_state_and_negative_take():
    s = EpochSampler(3, seed=0)
    with pytest.raises(ValueError):
        s.load_state_dict({"consumed": -1})
    with pytest.raises(ValueError):
        s.load_state_dict({"position": 2})
    with pytest.raises(ValueError):
        s.take(-1)
