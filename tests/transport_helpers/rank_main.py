"""One rank of a transport test, run as a subprocess by the tests. Prints progress lines on stdout.

    rank_main.py send-stream JOB RANK WORLD PEER COUNT SEED [SLOT_BYTES NUM_SLOTS]
    rank_main.py send-then-exit JOB RANK WORLD PEER COUNT SEED   # sends, flushes, exits without close()
    rank_main.py serve JOB RANK WORLD [SLOT_BYTES NUM_SLOTS]       # receives with recv() until killed
    rank_main.py recv-stream JOB RANK WORLD PEER COUNT SEED [SLOT_BYTES NUM_SLOTS]
    rank_main.py idle-wait JOB RANK WORLD PEER SECONDS              # blocks in wait_any; reports its CPU time
    rank_main.py interruptible JOB RANK WORLD PEER                  # blocks in recv until Ctrl-C (SIGINT)
"""

import json
import os
import signal
import sys
import time

from common import message_for, process_cpu_seconds, same_bits

from megatron_app.transport import Direction, Transport, TransportTimeout, make_tag


def transport_from(argv, extra_index):
    job, rank, world = argv[0], int(argv[1]), int(argv[2])
    options = {}
    if len(argv) > extra_index + 1:
        options = {"slot_bytes": int(argv[extra_index]), "num_slots": int(argv[extra_index + 1])}
    return Transport(rank, world, job, timeout_s=60, **options)


def send_stream(argv, close_at_end=True):
    peer, count, seed = int(argv[3]), int(argv[4]), int(argv[5])
    transport = transport_from(argv, 6)
    print("READY", flush=True)
    for index in range(count):
        transport.send(peer, make_tag(Direction.FORWARD, index), message_for(seed, index))
        if index % 32 == 31:  # several in flight, bounded memory
            transport.wait_sends()
    transport.wait_sends()
    print("SENT", flush=True)
    if not close_at_end:
        os._exit(0)  # no close(), no destructors: like a crash right after the sends completed
    transport.close()
    print("DONE", flush=True)


def recv_stream(argv):
    peer, count, seed = int(argv[3]), int(argv[4]), int(argv[5])
    transport = transport_from(argv, 6)
    print("READY", flush=True)
    for index in range(count):
        received = transport.recv(peer, make_tag(Direction.FORWARD, index))
        if not same_bits(received, message_for(seed, index)):
            print(f"MISMATCH {index}", flush=True)
            return
    print("VERIFIED", flush=True)
    transport.close()


def serve(argv):
    transport = transport_from(argv, 3)
    print("READY", flush=True)
    index = 0
    while True:
        key = transport.wait_any([(peer, make_tag(Direction.FORWARD, index)) for peer in transport.peers])
        transport.try_recv(*key)
        print(f"GOT {index}", flush=True)
        index += 1


def idle_wait(argv):
    peer, seconds = int(argv[3]), float(argv[4])
    transport = transport_from(argv, 5)
    print("READY", flush=True)
    start_wall, start_cpu = time.monotonic(), process_cpu_seconds()
    try:
        transport.wait_any([(peer, make_tag(Direction.FORWARD, 0))], timeout=seconds)
        outcome = "arrived"
    except TransportTimeout:
        outcome = "timeout"
    wall, cpu = time.monotonic() - start_wall, process_cpu_seconds() - start_cpu
    print("RESULT " + json.dumps({"outcome": outcome, "wall_s": wall, "cpu_s": cpu}), flush=True)
    transport.close()


def interruptible(argv):
    peer = int(argv[3])
    # Ctrl-C must reach Python whatever this process inherited: a SIGINT ignored or blocked by the process that
    # started it (the test ran after others in one pytest worker and got no KeyboardInterrupt, twice).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    transport = transport_from(argv, 4)
    start = time.monotonic()
    try:     # READY inside: a Ctrl-C that lands before recv blocks (a descheduled process) is caught too
        print("READY", flush=True)
        transport.recv(peer, make_tag(Direction.FORWARD, 0), timeout=60)
    except KeyboardInterrupt:
        print(f"INTERRUPTED {time.monotonic() - start:.3f}", flush=True)
    transport.close()


def main():
    command, argv = sys.argv[1], sys.argv[2:]
    if command == "send-stream":
        send_stream(argv)
    elif command == "send-then-exit":
        send_stream(argv, close_at_end=False)
    elif command == "recv-stream":
        recv_stream(argv)
    elif command == "serve":
        serve(argv)
    elif command == "idle-wait":
        idle_wait(argv)
    elif command == "interruptible":
        interruptible(argv)
    else:
        sys.exit(f"rank_main.py: unknown command {command!r}")


if __name__ == "__main__":
    main()
