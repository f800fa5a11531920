"""Smoke test of tools/bench_transport.py: a quick run prints the table and writes complete JSON."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench_transport.py"


def run_bench(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)


def test_quick_run_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run_bench("--quick", "--seconds", "0.02", "--json", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["size", "ours", "med"]
    assert [line.split()[0] for line in lines[2:4]] == ["4K", "1M"]
    assert lines[4].startswith("load average")
    document = json.loads(out.read_text())
    assert [row["size"] for row in document["rows"]] == [4096, 1 << 20]
    for row in document["rows"]:
        for key in ("ours_latency_median_us", "ours_latency_p99_us", "gloo_latency_median_us", "ours_gbs",
                    "gloo_gbs", "memcpy_gbs", "ours_over_memcpy", "ours_over_gloo"):
            assert row[key] > 0, key
        assert row["ours_latency_p99_us"] >= row["ours_latency_median_us"]
        assert abs(row["ours_over_memcpy"] - row["ours_gbs"] / row["memcpy_gbs"]) < 1e-9


def test_bad_arguments_give_one_line_and_non_zero_exit():
    result = run_bench("--sizes", "lots")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench_transport.py: error: argument --sizes: not a size: 'lots' (use e.g. 4K, 16M)"
    ]
