"""Smoke tests of tools/bench_transport.py: quick runs of each section print their table and write complete JSON;
the tcp section runs across two network namespaces when root (and removes them), over loopback otherwise; bad
flags give one line and exit status 2."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netns_hosts import netns_unavailable_reason

from megatron_app.transport import rdma_status

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench_transport.py"
QUICK = ["--quick", "--seconds", "0.02"]
NETNS_UNAVAILABLE = netns_unavailable_reason()


def run_bench(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)


def table_after(lines, title_prefix):
    """The rows of the table printed under the line starting with title_prefix: (header, [row lines])."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title_prefix))
    header, rows = lines[start + 1], []
    for line in lines[start + 3:]:
        if not line.strip() or not line.split()[0][0].isdigit():
            break
        rows.append(line)
    return header, rows


def check_remote_rows(rows, backend):
    assert [row["size"] for row in rows] == [4096, 1 << 20]
    for row in rows:
        for name in (backend, "raw", "gloo"):
            assert row[f"{name}_gbs"] > 0, name
            assert row[f"{name}_latency_p99_us"] >= row[f"{name}_latency_median_us"] > 0, name
        assert row[f"{backend}_over_raw"] == pytest.approx(row[f"{backend}_gbs"] / row["raw_gbs"])
        assert len(row[f"{backend}_bursts_gbs"]) == len(row["raw_bursts_gbs"]) == 6
        assert row[f"{backend}_gbs"] == max(row[f"{backend}_bursts_gbs"]) and row[f"{backend}_over_raw_median"] > 0
        assert row[f"{backend}_over_gloo"] == pytest.approx(row[f"{backend}_gbs"] / row["gloo_gbs"])


def test_shm_rdma_and_loss_compare_sections(tmp_path):
    out = tmp_path / "bench.json"
    result = run_bench("--backends", "shm,rdma", "--loss-compare", *QUICK, "--json", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    header, rows = table_after(lines, "shm:")
    assert header.split()[:3] == ["size", "ours", "med"]
    assert [row.split()[0] for row in rows] == ["4K", "1M"]
    assert lines[-1].startswith("load average")
    document = json.loads(out.read_text())
    assert document["backends"] == ["shm", "rdma"]
    assert [row["size"] for row in document["rows"]] == [4096, 1 << 20]
    for row in document["rows"]:
        for key in ("ours_latency_median_us", "ours_latency_p99_us", "gloo_latency_median_us", "ours_gbs",
                    "gloo_gbs", "memcpy_gbs", "ours_over_memcpy", "ours_over_gloo"):
            assert row[key] > 0, key
        assert row["ours_latency_p99_us"] >= row["ours_latency_median_us"]
        assert abs(row["ours_over_memcpy"] - row["ours_gbs"] / row["memcpy_gbs"]) < 1e-9

    built, usable, _ = rdma_status()
    if built and usable:
        check_remote_rows(document["rdma"]["rows"], "rdma")
    else:
        assert [line for line in lines if line.startswith("rdma:")] == [
            f"rdma: skipped ({document['rdma']['skipped']})"]
        assert document["rdma"]["skipped"].startswith("no RDMA device")

    compare = document["loss_compare"]
    assert compare["loss"] == {"model": "bernoulli", "rate": 0.0} and compare["repeats"] == 2
    assert [row["size"] for row in compare["rows"]] == [1 << 20, 16 << 20]
    for row in compare["rows"]:
        assert len(row["off_gbs"]) == len(row["on_gbs"]) == len(row["control_gbs"]) == 2
        assert min(row["off_gbs"] + row["on_gbs"] + row["control_gbs"]) > 0
        assert row["on_over_off"] == pytest.approx(row["on_median_gbs"] / row["off_median_gbs"])
        assert row["control_over_off_paired_median"] > 0
        assert row["layer_packets"] == row["layer_packets_expected"] > 0 and row["layer_lost"] == 0
    _, loss_rows = table_after(lines, "loss layer cost")
    assert [row.split()[0] for row in loss_rows] == ["1M", "16M"]


def test_tcp_over_loopback(tmp_path):
    out = tmp_path / "bench.json"
    result = run_bench("--backends", "tcp", "--loopback", *QUICK, "--json", str(out))
    assert result.returncode == 0, result.stderr
    section = json.loads(out.read_text())["tcp"]
    assert section["link"] == "loopback" and "--loopback given" in section["link_description"]
    check_remote_rows(section["rows"], "tcp")
    header, rows = table_after(result.stdout.splitlines(), "tcp: loopback")
    assert "tcp/raw" in header.split() and [row.split()[0] for row in rows] == ["4K", "1M"]


@pytest.mark.skipif(NETNS_UNAVAILABLE is not None, reason=str(NETNS_UNAVAILABLE))
def test_tcp_across_namespaces_with_a_rate_limit_and_no_leftovers(tmp_path):
    out = tmp_path / "bench.json"
    process = subprocess.Popen([sys.executable, str(BENCH), "--backends", "tcp", "--rate", "200mbit", *QUICK,
                                "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    section = json.loads(out.read_text())["tcp"]
    assert section["link"] == "veth" and section["rate"] == "200mbit"
    check_remote_rows(section["rows"], "tcp")
    # 200 Mbit/s is 0.025 GB/s: every stream over the shaped link stays near it (far below an unshaped veth).
    for row in section["rows"]:
        for name in ("tcp", "raw", "gloo"):
            assert row[f"{name}_gbs"] < 0.04, (name, row)
    assert "tc tbf 200mbit" in stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"mbt{process.pid % 100000}h" not in namespaces


@pytest.mark.parametrize("flags, message", [
    (["--sizes", "lots"], "argument --sizes: not a size: 'lots' (use e.g. 4K, 16M)"),
    (["--backends", "shm,udp"], "argument --backends: unknown backend(s) ['udp']: choose from shm, tcp, rdma or none"),
    (["--backends", "none"], "--backends none leaves nothing to run; add --loss-compare"),
    (["--rate", "fast"], "argument --rate: not a rate: 'fast' (use e.g. 500mbit, 1gbit, 10gbit)"),
    (["--backends", "shm", "--rate", "1gbit"], "--rate applies to the tcp section; add tcp to --backends"),
    (["--loss-model", "bernoulli", "--loss-rate", "2"], "--loss-rate must be a probability in [0, 1], got 2.0"),
])
def test_bad_arguments_give_one_line_and_non_zero_exit(flags, message):
    result = run_bench(*flags)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"bench_transport.py: error: {message}"]


def check_cuda_rows(rows, sizes):
    assert [row["size"] for row in rows] == sizes
    for row in rows:
        assert row["bit_exact"] is True
        for method in ("ours", "ours_block", "ours_arena", "ours_8m", "ipc", "ipc_block", "d2d", "pinned", "pageable",
                       "gloo"):
            assert row[f"{method}_gbs"] > 0 and row[f"{method}_us"] > 0, method
        assert row["ours_over_pinned"] == pytest.approx(row["ours_gbs"] / row["pinned_gbs"])
        for name in ("ours", "ipc"):  # both event waits measured, the faster named
            faster = "spin" if row[f"{name}_s"] <= row[f"{name}_block_s"] else "block"
            assert row[f"faster_wait_{name}"] == faster
            assert row[f"{name}_block_over_spin"] == pytest.approx(row[f"{name}_block_s"] / row[f"{name}_s"])
        assert row["turn_us"] > 0 and row["host_msg_us"] > 0
        assert row["slots_over_arena"] == pytest.approx(row["ours_s"] / row["ours_arena_s"])
        assert row["big_slots_over_ours"] == pytest.approx(row["ours_8m_s"] / row["ours_s"])
        assert row["ours_8m_over_pinned"] == pytest.approx(row["ours_8m_gbs"] / row["pinned_gbs"])
        for name in ("ours", "ipc"):
            assert row[f"floor_over_{name}"] == pytest.approx(row["turn_us"] / row[f"{name}_us"])


def test_cuda_section_rehearsed_on_host_tensors(tmp_path):
    out = tmp_path / "cuda.json"
    result = run_bench("--device", "cuda", "--rehearsal", "--sizes", "64K", "--seconds", "0.01", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "cuda: two processes on one host (rehearsal)" in result.stdout and "bit-exact: yes" in result.stdout
    assert "faster event wait, ours: 64K " in result.stdout and "per message between the two processes" in result.stdout
    document = json.loads(out.read_text())
    assert document["device"] == "cuda" and document["cuda"]["device"] == "host (rehearsal)"
    check_cuda_rows(document["cuda"]["rows"], [64 * 1024])
    row = document["cuda"]["rows"][0]  # the device path's code ran (a host engine), not the core's host path
    assert row["ours_path"] == row["ipc_path"] == "slots, not registered"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_device_cuda_without_cuda_is_one_line_and_non_zero():
    result = run_bench("--device", "cuda")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"bench_transport.py: error: --device cuda needs a CUDA device; torch {__import__('torch').__version__} "
        "sees none"]


@pytest.mark.cuda
def test_cuda_section_on_the_gpu(tmp_path):
    out = tmp_path / "cuda.json"
    result = run_bench("--device", "cuda", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["cuda"]["rows"]
    check_cuda_rows(rows, [64 * 1024, 1 << 20])
    assert {row["ours_path"] for row in rows} <= {"slots, registered", "slots, not registered"}
    assert all(row["ipc_path"].startswith("cuda ipc") for row in rows)


def test_a_crashed_ipc_section_leaves_the_staged_columns_and_fails_the_run(tmp_path, monkeypatch, capsys):
    """The H100 run of 2026-11-26 lost every column when one rank crashed: the IPC transports now run in processes
    of their own, and a crash there empties their columns only."""
    from megatron_app.bench.transport import cli

    real_run_section = cli.run_section

    def ipc_crashes(plan, scratch, timeout_s, *rest):
        if plan["section"] == "cuda_ipc":
            raise cli.BenchError("cuda_ipc rank 0 failed: killed by SIGSEGV in File \"device_engine.py\", line 151")
        return real_run_section(plan, scratch, timeout_s, *rest)

    monkeypatch.setattr(cli, "run_section", ipc_crashes)
    out = tmp_path / "cuda.json"
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(["--device", "cuda", "--rehearsal", "--sizes", "64K", "--seconds", "0.01", "--json",
                     str(out)]) == 1
    # its SIGTERM handler is gone again: processes this one forks later (a test's multiprocessing pool) die of
    # SIGTERM as usual (with it left behind, a pool's terminate hung in a later test)
    assert signal.getsignal(signal.SIGTERM) is handler
    printed = capsys.readouterr()
    assert "bench_transport.py: error: the IPC section failed (cuda_ipc rank 0 failed: killed by SIGSEGV" in printed.err
    section = json.loads(out.read_text())["cuda"]
    row = section["rows"][0]
    assert section["ipc_error"].startswith("cuda_ipc rank 0 failed")
    assert row["ours_gbs"] > 0 and row["gloo_gbs"] > 0 and row["d2d_gbs"] > 0 and "ipc_gbs" not in row
    assert " - " in printed.out   # the table shows the empty columns


def test_a_rank_killed_by_a_signal_is_named_with_its_innermost_frame(tmp_path):
    from megatron_app.bench.transport.cli import last_error_line

    log = tmp_path / "rank0.log"
    log.write_text("Fatal Python error: Segmentation fault\n\nThread 0x01 (most recent call first):\n"
                   "  File \"/x/threading.py\", line 355 in wait\n\nCurrent thread 0x02 (most recent call first):\n"
                   "  File \"/x/device_engine.py\", line 151 in _export_event\n  File \"/x/device_ipc.py\", line 142 "
                   "in send\n")
    assert last_error_line(log, -11) == 'killed by SIGSEGV in File "/x/device_engine.py", line 151 in _export_event'
    assert last_error_line(log, 1) == 'File "/x/device_ipc.py", line 142 in send'
    (tmp_path / "empty.log").write_text("")
    assert last_error_line(tmp_path / "empty.log", -9) == "killed by SIGKILL"
    assert last_error_line(tmp_path / "empty.log", 1) == "no output"
