import pytest

from megatron_app.runtime import set_microbatch_lengths, take_microbatch_lengths


def test_lengths_are_taken_once():
    set_microbatch_lengths([64, 12, 40])
    assert take_microbatch_lengths(3) == (64, 12, 40)
    assert take_microbatch_lengths(3) is None


def test_wrong_count_and_bad_values_are_refused():
    set_microbatch_lengths([64, 12])
    with pytest.raises(ValueError, match="2 microbatch lengths"):
        take_microbatch_lengths(3)
    with pytest.raises(ValueError, match="positive"):
        set_microbatch_lengths([5, 0])
