"""A rank in its own process for the TCP tests: prints its address, reads the peer's from stdin, then acts.

    python tcp_peer.py ROLE RANK PEER JOB_ID
ROLE: echo  - receives COUNT tensors (first line after the address: COUNT) and sends each back, then closes.
      hang  - connects and sends one tensor, then sleeps until killed (for death tests).
"""

import sys
import time

import torch

from megatron_app.transport import Direction, Transport, make_tag


def main():
    role, rank, peer, job_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    transport = Transport(rank, 2, job_id, backends={peer: "tcp"}, timeout_s=30)
    print(transport.local_address("tcp"), flush=True)
    transport.set_peer_addresses({peer: sys.stdin.readline().strip()})
    if role == "echo":
        count = int(sys.stdin.readline())
        for index in range(count):
            tensor = transport.recv(peer, make_tag(Direction.FORWARD, index))
            transport.send(peer, make_tag(Direction.BACKWARD, index), tensor)
        transport.wait_sends(timeout=30)
        transport.close()
        print("DONE", flush=True)
    elif role == "hang":
        transport.send(peer, make_tag(Direction.FORWARD, 0), torch.arange(10))
        transport.wait_sends(timeout=30)
        print("SENT", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
