"""measure_clock_offset over real gloo processes whose clocks are skewed on purpose."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, sys, time
    rank, world, port, skew_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    real = time.monotonic_ns
    time.monotonic_ns = lambda: real() + int(skew_s * 1e9)   # this process's clock runs skew_s ahead
    import torch.distributed as dist
    from megatron_app.runtime.clock_offset import measure_clock_offset
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    world_offset = measure_clock_offset(rounds=6)
    pair = dist.new_group([1, 2])
    pair_offset = measure_clock_offset(group=pair, rounds=6) if rank in (1, 2) else None
    # same kernel as the root: the clock is trusted as shared, so even the faked skew is not estimated
    shared_offset = measure_clock_offset(rounds=6, trust_shared_clock=True)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"world": world_offset, "pair": pair_offset, "shared": shared_offset}))
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_offsets_undo_the_skew_against_rank_0_and_against_a_group_root(tmp_path):
    pytest.importorskip("torch.distributed")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    skews = [0.0, 2.0, -3.0]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), "3", str(port), str(skew)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
             for rank, skew in enumerate(skews)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nclock offset errors (us): rank1 {results[1]['world'] + 2e6:.1f}, rank2 {results[2]['world'] - 3e6:.1f}, "
          f"pair {results[2]['pair'] - 5e6:.1f}")
    tolerance_us = 20_000.0  # min-RTT sample on a shared 2-core machine; loopback RTT is normally ~0.1 ms
    assert results[0]["world"] == 0.0
    assert results[1]["world"] == pytest.approx(-2e6, abs=tolerance_us)  # ahead by 2 s: subtract 2 s
    assert results[2]["world"] == pytest.approx(3e6, abs=tolerance_us)
    assert results[1]["pair"] == 0.0  # rank 1 is the group's root
    assert results[2]["pair"] == pytest.approx(5e6, abs=tolerance_us)
    assert [result["shared"] for result in results] == [0.0, 0.0, 0.0]


def test_needs_an_initialized_process_group():
    from megatron_app.runtime.clock_offset import measure_clock_offset
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialized"):
        measure_clock_offset()
