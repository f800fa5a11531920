"""Admission to a rank's TCP listener: a connection must prove the job's secret (an HMAC of the listener's fresh
challenge) before its hello is read. Strangers that know the job id, silent connections, garbage and connect
storms are dropped and counted, never named as a peer, and cost the real peers no start-up time."""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import socket
import struct
import time

import pytest
import torch

from megatron_app.transport import Direction, Transport, TransportClosed, make_tag

# The wire, as csrc/shm_tensor_rdma/core/admission.h and tcp/tcp_frame.h define it.
ADMISSION_MAGIC, ADMISSION_VERSION = 0x4E44414D, 1
CHALLENGE = struct.Struct("<II32s")
DOMAIN = b"megatron_app admission v1\0"
TCP_MAGIC, TCP_VERSION, JOB_ID_BYTES = 0x5450414D, 1, 64
FRAME_BYTES = 8 + 8 + 8 + 4 + 4 + 8 * 32  # magic, kind, MessageHeader
BYE = 2
SECRET = bytes(range(32))


def job():
    return f"adm{os.getpid()}x{time.monotonic_ns() % 10**9}"


def hello(rank, job_id):
    return struct.pack("<IIiI", TCP_MAGIC, TCP_VERSION, rank, 0) + job_id.encode().ljust(JOB_ID_BYTES, b"\0")


def proof(secret, job_id, challenge):
    magic, version, nonce = CHALLENGE.unpack(challenge)
    assert (magic, version) == (ADMISSION_MAGIC, ADMISSION_VERSION)
    mac = hmac.new(secret, DOMAIN + job_id.encode() + b"\0" + nonce, hashlib.sha256).digest()
    return struct.pack("<II", ADMISSION_MAGIC, ADMISSION_VERSION) + mac


def connect(address):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_challenge(sock):
    data = b""
    while len(data) < CHALLENGE.size:
        chunk = sock.recv(CHALLENGE.size - len(data))
        assert chunk, "the listener closed before its challenge"
        data += chunk
    return data


def assert_dropped(sock):
    """The listener closed the connection (a reset when our hello was still unread)."""
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def open_pair(job_id, secret=SECRET):
    a = Transport(0, 2, job_id, backends={1: "tcp"}, timeout_s=30, admission_secret=secret)
    b = Transport(1, 2, job_id, backends={0: "tcp"}, timeout_s=30, admission_secret=secret)
    return a, b


def link_and_exchange(a, b, iteration=0):
    """Addresses in (first time), then one message each way; returns the seconds from the first send to the last
    arrival (the first time: connecting and admission included)."""
    if iteration == 0:
        a.set_peer_addresses({1: b.local_address("tcp")})
        b.set_peer_addresses({0: a.local_address("tcp")})
    start = time.monotonic()
    tag_f, tag_b = make_tag(Direction.FORWARD, 0, iteration), make_tag(Direction.BACKWARD, 0, iteration)
    sent = torch.arange(16, dtype=torch.float32)
    a.send(1, tag_f, sent)
    b.send(0, tag_b, sent * 2)
    assert torch.equal(b.recv(0, tag_f, timeout=20), sent)
    assert torch.equal(a.recv(1, tag_b, timeout=20), sent * 2)
    return time.monotonic() - start


def test_a_proof_made_with_the_secret_is_admitted_and_named():
    """The wire format as documented: a Python peer that knows the secret proves it, says hello as rank 1 and says
    goodbye; rank 0 reports rank 1 closed (it was admitted as rank 1). HMAC-SHA256 matches Python's."""
    job_id = job()
    a = Transport(0, 2, job_id, backends={1: "tcp"}, timeout_s=30, admission_secret=SECRET)
    try:
        with connect(a.local_address("tcp")) as sock:
            sock.sendall(proof(SECRET, job_id, read_challenge(sock)) + hello(1, job_id))
            sock.sendall(struct.pack("<II", TCP_MAGIC, BYE) + bytes(FRAME_BYTES - 8))
            with pytest.raises(TransportClosed, match="rank 1 closed its transport"):
                a.recv(1, make_tag(Direction.FORWARD, 0, 0), timeout=10)
        assert a.strangers_dropped == 0
    finally:
        a.close()


def test_a_stranger_with_the_job_id_but_not_the_secret_cannot_claim_a_rank():
    """Before admission, a hello with the right magic, version and job id claimed rank 1: the real rank 1 then
    failed with 'a second connection claims to be rank 1'."""
    job_id = job()
    a, b = open_pair(job_id)
    try:
        for wrong in (b"", b"x" * 32):
            with connect(a.local_address("tcp")) as sock:
                challenge = read_challenge(sock)
                sock.sendall(proof(wrong, job_id, challenge) + hello(1, job_id))
                assert_dropped(sock)
        with connect(a.local_address("tcp")) as sock:  # a replayed proof answers another challenge
            read_challenge(sock)
            sock.sendall(proof(SECRET, job_id, CHALLENGE.pack(ADMISSION_MAGIC, 1, bytes(32))) + hello(1, job_id))
            assert_dropped(sock)
        wait_for(lambda: a.strangers_dropped == 3)
        link_and_exchange(a, b)
        assert a.strangers_dropped == 3 and b.strangers_dropped == 0
    finally:
        a.close()
        b.close()


def _clean_start_up_seconds():
    a, b = open_pair(job())
    try:
        return link_and_exchange(a, b)
    finally:
        a.close()
        b.close()


def test_silent_connections_garbage_and_a_connect_storm_cost_peers_nothing():
    """Strangers arrive before the real peers (start-up) and keep coming while they exchange (training)."""
    clean = _clean_start_up_seconds()
    job_id = job()
    a, b = open_pair(job_id)
    rng = random.Random(25)
    silent = []
    try:
        for transport in (a, b):
            address = transport.local_address("tcp")
            silent += [connect(address) for _ in range(8)]              # connect, then say nothing
            for _ in range(32):                                         # garbage, and a storm of short ones
                with connect(address) as sock:
                    sock.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))))
        with_strangers = link_and_exchange(a, b)
        assert with_strangers < clean + 1.0, (with_strangers, clean)
        for _ in range(16):                                             # during training
            with connect(a.local_address("tcp")) as sock:
                sock.sendall(hello(1, job_id) * 2)
        assert link_and_exchange(a, b, iteration=1) < clean + 1.0
        wait_for(lambda: a.strangers_dropped >= 32 + 16 and b.strangers_dropped >= 32)
    finally:
        for sock in silent:
            sock.close()
        a.close()
        b.close()


OUT_OF_DESCRIPTORS_CHILD = r"""
import os, resource, sys, time
from megatron_app.transport import Transport
transport = Transport(0, 2, sys.argv[1], backends={1: "tcp"}, timeout_s=30, admission_secret=bytes(32))
address = transport.local_address("tcp")
# The lowest free descriptor becomes the limit: the listener's next accept4 fails with EMFILE. Set before the
# address is told, so no connection can be accepted first (on a loaded machine one was).
open_fds = {int(name) for name in os.listdir("/proc/self/fd")}
lowest_free = min(set(range(len(open_fds) + 1)) - open_fds)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(address, flush=True)
sys.stdin.readline()  # the parent has connected
before = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(1.0)
after = resource.getrusage(resource.RUSAGE_SELF)
print(f"{after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.3f}", flush=True)
transport.close()
"""


def test_running_out_of_descriptors_pauses_accepting_and_is_reported_once():
    """With no descriptor left, waiting connections keep the listening socket ready: accepting again at once would
    spin a core. The listener must back off (the process's CPU time over a second stays low) and say so once."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS_CHILD, job()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        sockets = [connect(address) for _ in range(5)]
        child.stdin.write("go\n")
        child.stdin.flush()
        cpu_s = float(child.stdout.readline())
        child.wait(timeout=30)
    finally:
        child.kill()
    stderr = child.stderr.read()
    for sock in sockets:
        sock.close()
    assert stderr.count("out of file descriptors") == 1, stderr
    assert "EMFILE" in stderr
    assert cpu_s < 0.25, f"the listener spun: {cpu_s} s of CPU in 1 s"
