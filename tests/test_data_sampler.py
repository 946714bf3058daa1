"""PromptSampler: permutation per epoch, full batches across epochs, exact resume from state_dict."""

from __future__ import annotations

import pytest

from megatron_opd.data.sampler import PromptSampler

RECORDS = list(range(10))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    s = PromptSampler(RECORDS, seed=3, shuffle=True, batch_size=4)
    epochs = []
    for _ in range(3):
        seen = [x for batch in s.epoch_batches() for x in batch]
        assert sorted(seen) == RECORDS
        epochs.append(seen)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert s.epoch == 3 and s.position == 0


def test_epoch_batch_sizes_and_no_shuffle_order():
    s = PromptSampler(RECORDS, seed=0, shuffle=False, batch_size=4)
    assert list(s.epoch_batches()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_next_batch_is_always_full_and_crosses_epochs():
    s = PromptSampler(RECORDS, seed=1, batch_size=4)
    stream = [x for _ in range(5) for x in s.next_batch()]  # 20 draws = exactly 2 epochs
    assert sorted(stream[:10]) == RECORDS and sorted(stream[10:]) == RECORDS
    assert stream[:10] == list(s.order(0)) and stream[10:] == list(s.order(1))


def test_same_seed_same_stream_other_seed_differs():
    a = PromptSampler(RECORDS, seed=7, batch_size=3)
    b = PromptSampler(RECORDS, seed=7, batch_size=3)
    c = PromptSampler(RECORDS, seed=8, batch_size=3)
    sa = [a.next_batch() for _ in range(6)]
    assert sa == [b.next_batch() for _ in range(6)]
    assert sa != [c.next_batch() for _ in range(6)]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_resume_reproduces_the_same_next_batches(stop_after):
    ref = PromptSampler(RECORDS, seed=5, batch_size=3)
    expected = [ref.next_batch() for _ in range(12)]
    run = PromptSampler(RECORDS, seed=5, batch_size=3)
    for _ in range(stop_after):
        run.next_batch()
    state = dict(run.state_dict())
    resumed = PromptSampler(list(RECORDS), seed=5, batch_size=3)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(12 - stop_after)] == expected[stop_after:]


def test_load_state_rejects_other_data_or_seed():
    s = PromptSampler(RECORDS, seed=5)
    s.next_batch(3)
    state = s.state_dict()
    with pytest.raises(ValueError, match="seed=5 in the checkpoint"):
        PromptSampler(RECORDS, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="num_records=10"):
        PromptSampler(RECORDS[:9], seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="bad position"):
        PromptSampler(RECORDS, seed=5).load_state_dict({**state, "position": 10})


def test_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(RECORDS, batch_size=0)
