"""Receives that take their message straight from the slots (device_staging.receive_through_slots): a receive
claims its message only if it has not begun to arrive, so these helpers start the sender once the claim is in."""

from __future__ import annotations

import threading

from megatron_app.transport import Direction, make_tag

FWD = Direction.FORWARD


class ClaimSignal:
    """The core of a receiving Transport, telling the test when a receive has claimed its message (the sender
    starts then, so the message is taken from the slots, never first copied out by the core)."""

    def __init__(self, core):
        self._core = core
        self.claimed = threading.Event()

    def __getattr__(self, name):
        return getattr(self._core, name)

    def claim_receive(self, peer, tag):
        claimed = self._core.claim_receive(peer, tag)
        if claimed:
            self.claimed.set()
        return claimed


def receive_claimed(sender, receiver, tensors, device="cpu"):
    """Each tensor sent once the receiver's recv(device=...) has claimed it; the received tensors."""
    signal = receiver._core = ClaimSignal(receiver._core)
    received, errors = [], []

    def send_each():
        try:
            for index, tensor in enumerate(tensors):
                assert signal.claimed.wait(20), "the receive never claimed its message"
                signal.claimed.clear()
                sender.send(1, make_tag(FWD, index), tensor).wait(timeout=20)
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    thread = threading.Thread(target=send_each)
    thread.start()
    try:
        for index in range(len(tensors)):
            received.append(receiver.recv(0, make_tag(FWD, index), device=device))
    finally:
        thread.join(30)
    assert not errors, errors
    return received
