"""Slow-link emulation: the spec, the simulator's network under the same rule, and the deferring transport wrapper
(with a stand-in transport that records when each send reaches it)."""

import time

import pytest

from megatron_app.schedule import ScheduleConfigError
from megatron_app.emulation import SlowLink, SlowLinkNetwork
from megatron_app.emulation.link_delay import DelayedSendTransport, DelayWindows


def test_spec_parses_and_applies_only_on_its_link_inside_the_window():
    spec = SlowLink.parse_delay("1-2:0-300:12")
    assert str(spec) == "1-2:0-300:12"
    assert spec.delay_at_us(1, 2, 0.0) == 12_000 and spec.delay_at_us(2, 1, 299_900.0) == 12_000
    assert spec.delay_at_us(1, 2, 300_000.0) == 0 and spec.delay_at_us(0, 1, 10_000.0) == 0
    with pytest.raises(ScheduleConfigError, match="rank 5 is outside"):
        SlowLink.parse_delay("1-5:0-1:1").check_ranks(4)


def test_several_link_delays_each_apply_the_longest_where_they_overlap():
    windows = DelayWindows([SlowLink.parse_delay("1-2:0-300:12"), SlowLink.parse_delay("0-1:0-10:5"),
                            SlowLink.parse_delay("1-2:100-200:30")])
    assert windows.delay_at_us(0, 1, 0.0) == 5_000 and windows.delay_at_us(2, 1, 50_000.0) == 12_000
    assert windows.delay_at_us(1, 2, 150_000.0) == 30_000 and windows.delay_at_us(0, 1, 20_000.0) == 0
    with pytest.raises(ScheduleConfigError, match="rank 3 is outside"):
        DelayWindows([SlowLink.parse_delay("0-1:0-1:1"), SlowLink.parse_delay("1-3:0-1:1")]).check_ranks(3)


@pytest.mark.parametrize("text", ["1-2", "1-1:0-5:1", "1-2:5-5:1", "a-b:0-1:1", "1-2:0-1:-3"])
def test_spec_rejects_malformed_text(text):
    with pytest.raises(ScheduleConfigError):
        SlowLink.parse_delay(text)


def test_network_delays_window_messages_and_keeps_the_link_fifo():
    network = SlowLinkNetwork(SlowLink.parse_delay("1-2:0-10:5"), latency_us=100.0)
    network.begin_iteration(1_000.0)
    assert network.send(0, 1, 2_000.0) == (2_000.0, 2_100.0)          # another link: latency only
    assert network.send(1, 2, 2_000.0) == (2_000.0, 7_100.0)          # in the window: +5 ms
    assert network.send(1, 2, 12_000.0) == (12_000.0, 12_100.0)      # after the window
    network.begin_iteration(20_000.0)
    assert network.send(2, 1, 20_500.0)[1] == 25_600.0
    assert network.send(2, 1, 30_000.0)[1] == 30_100.0
    # FIFO: a message after the window cannot overtake a delayed one.
    network.begin_iteration(40_000.0)
    assert network.send(1, 2, 49_900.0)[1] == 55_000.0
    assert network.send(1, 2, 50_000.0)[1] == 55_000.0


class _Handle:
    def done(self):
        return True

    def wait(self, timeout=None):
        pass


class _RecordingTransport:
    """Records (monotonic time, peer, tag) of every send that reaches it; nothing ever arrives."""

    def __init__(self):
        from megatron_app.transport import TransportTimeout

        self.sent = []
        self.closed = False
        self._timeout = TransportTimeout

    def send(self, peer, tag, tensor):
        self.sent.append((time.monotonic(), peer, tag))
        return _Handle()

    def poll(self):
        return []

    def wait_any(self, keys, timeout=None):
        time.sleep(timeout)
        raise self._timeout("nothing arrived")

    def wait_sends(self, timeout=None):
        pass

    def close(self):
        self.closed = True


def _wrapped(spec="0-1:0-1000:60"):
    inner = _RecordingTransport()
    # pipeline ranks 0, 1, 2 are global ranks 10, 11, 12; this is pipeline rank 0
    return inner, DelayedSendTransport(inner, SlowLink.parse_delay(spec), [10, 11, 12], pp_rank=0)


def test_sends_off_the_slow_link_go_out_at_once():
    inner, transport = _wrapped("1-2:0-1000:60")
    handle = transport.send(11, 5, object())
    assert len(inner.sent) == 1 and handle.done()


def test_a_window_send_is_deferred_and_posted_by_a_compute_wait():
    inner, transport = _wrapped()
    posted = time.monotonic()
    handle = transport.send(11, 7, object())
    assert inner.sent == [] and not handle.done()
    transport.wait(0.100)                  # an emulated compute wait spans the due time
    assert [tag for _, _, tag in inner.sent] == [7]
    assert 0.058 <= inner.sent[0][0] - posted < 0.090
    assert handle.done()


def test_waiting_for_input_wakes_up_to_post_a_due_send():
    inner, transport = _wrapped()
    from megatron_app.transport import TransportTimeout

    posted = time.monotonic()
    transport.send(11, 7, object())
    with pytest.raises(TransportTimeout):
        transport.wait_any([(11, 1)], timeout=0.120)
    assert len(inner.sent) == 1 and 0.058 <= inner.sent[0][0] - posted < 0.100


def test_the_link_stays_fifo_and_wait_sends_flushes_everything():
    inner, transport = _wrapped("0-1:0-30:60")
    transport.send(11, 1, object())
    time.sleep(0.040)                      # now outside the window, but the link still holds tag 1
    transport.send(11, 2, object())
    transport.send(12, 3, object())        # another peer: not held up
    assert [tag for _, _, tag in inner.sent] == [3]
    transport.wait_sends()
    assert [tag for _, _, tag in inner.sent] == [3, 1, 2]


def test_a_new_iteration_restarts_the_window():
    inner, transport = _wrapped("0-1:0-30:60")
    time.sleep(0.040)
    transport.send(11, 1, object())        # 40 ms into the iteration: outside the window
    transport.begin_iteration()
    transport.send(11, 2, object())        # inside again
    assert [tag for _, _, tag in inner.sent] == [1]
    transport.close()
    assert [tag for _, _, tag in inner.sent] == [1, 2] and inner.closed
