"""python -m megatron_app.sim: the comparison table, --json, --trace-dir, and one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_app.schedule import ADAPTIVE_POLICY_NAMES, PipelineShape, policies_for
from megatron_app.sim.cli import PROG, main

REPO = Path(__file__).resolve().parent.parent
BASE = ["--pipeline_parallel", "4", "--model_chunks", "2", "--microbatches", "8"]


def run_main(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:      # argparse errors exit by themselves
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out):
    rows = {}
    for line in out.splitlines()[2:]:
        fields = line.split()
        if len(fields) >= 6 and fields[0] != "interleaved:":
            rows[fields[0]] = dict(makespan=float(fields[1]), bound=float(fields[2]), ratio=float(fields[3]),
                                   bubble=fields[4], peaks=fields[5])
    return rows


def test_all_policies_table(capsys):
    code, out, err = run_main(capsys, *BASE)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "P=4 V=2 m=8 iterations=1 seed=0"
    rows = table_rows(out)
    assert list(rows) == list(policies_for(PipelineShape(4, 2, 8)))   # no 1f1b with model chunks, no zb-h1 unsplit
    assert "1f1b" not in rows and "zb-h1" not in rows
    pinned = {"dfc": 640.0, "bfc": 630.0, "interleaved": 570.0, "adaptive": 570.0, "planned": 570.0}
    assert {name: rows[name]["makespan"] for name in pinned} == pinned
    assert all(row["bound"] == 570.0 for row in rows.values())
    assert rows["adaptive"] == dict(makespan=570.0, bound=570.0, ratio=1.0, bubble="15.8%", peaks="11,9,7,5")


def test_json_and_perturbation_flags(capsys, tmp_path):
    out_file = tmp_path / "sim.json"
    code, out, _ = run_main(capsys, "--pipeline_parallel", "3", "--microbatches", "6", "--policy", "1f1b",
                            "--fwd-ms", "1", "--bwd-ms", "2", "--slow-rank", "2", "--slow-factor", "2",
                            "--jitter", "0.1", "--straggler-prob", "0.2", "--straggler-factor", "4",
                            "--link-latency-us", "30", "--link-gbps", "25", "--tensor-bytes", "1000000",
                            "--slow-link", "1-2:0-5:3", "--iterations", "2", "--seed", "4", "--json", out_file)
    assert code == 0
    data = json.loads(out_file.read_text())
    config = data["config"]
    assert (config["slow_rank"], config["slow_factor"], config["jitter"], config["straggler_prob"]) == (2, 2.0, 0.1,
                                                                                                         0.2)
    assert (config["link_gbps"], config["tensor_bytes"], config["slow_links"], config["seed"]) == (
        25.0, 1_000_000, ["1-2:0-5:3"], 4)
    assert config["forward_us"] == [[1000.0]] * 3
    (result,) = data["results"]
    assert result["policy"] == "1f1b" and len(result["iteration_makespans_us"]) == 2
    assert result["makespan_us"] >= result["lower_bound_us"] > 0
    assert table_rows(out)["1f1b"]["makespan"] == pytest.approx(result["makespan_us"] / 1000, abs=1e-3)


def test_trace_dirs(capsys, tmp_path):
    assert run_main(capsys, *BASE, "--trace-dir", tmp_path / "all")[0] == 0
    for name in ("dfc", "bfc", "interleaved", "adaptive"):
        assert sorted(p.name for p in (tmp_path / "all" / name).iterdir()) == [
            f"trace_rank{r}.jsonl" for r in range(4)]
    assert run_main(capsys, *BASE, "--policy", "dfc", "--trace-dir", tmp_path / "one")[0] == 0
    assert len(list((tmp_path / "one").glob("trace_rank*.jsonl"))) == 4


def test_a_cap_below_megatrons_skips_the_static_order(capsys):
    code, out, _ = run_main(capsys, *BASE, "--memory-cap", "4")
    assert code == 0 and list(table_rows(out)) == list(ADAPTIVE_POLICY_NAMES)
    assert "interleaved: skipped (policy 'interleaved' holds up to 11 activations on rank 0" in out
    assert table_rows(out)["adaptive"]["peaks"] == "4,4,4,4"


@pytest.mark.parametrize("extra, message", [
    (["--microbatches", "3"], "num_microbatches=3 must be >= num_stages=4"),
    (["--policy", "1f1b"], "policy '1f1b' needs num_chunks == 1"),
    (["--policy", "lifo"], "argument --policy: invalid choice: 'lifo'"),
    (["--slow-link", "0-2:0-1:2"], "slow link 0-2:0-1:2 carries no pipeline traffic"),
    (["--slow-link", "1-2:0-1"], "is not A-B:START_MS-END_MS:FACTOR"),
    (["--slow-factor", "2"], "--slow-factor needs --slow-rank"),
    (["--slow-rank", "4"], "slow_rank 4 is outside 0..3"),
    (["--slow-rank", "1", "--slow-factor", "0.5"], "expected a number >= 1, got '0.5'"),
    (["--jitter", "1"], "jitter must be >= 0 and < 1, got 1.0"),
    (["--straggler-prob", "1.5"], "expected a probability in [0, 1], got 1.5"),
    (["--fwd-ms", "-1"], "expected a number >= 0, got '-1'"),
    (["--link-gbps", "0"], "expected a number > 0, got '0'"),
    (["--tensor-bytes", "x"], "expected an integer >= 0, got 'x'"),
    (["--memory-cap", "1"], "memory_cap=1 cannot finish"),
    (["--iterations", "0"], "expected a positive integer, got '0'"),
])
def test_bad_input_is_one_line(capsys, extra, message):
    argv = BASE[:4] + (extra if extra[0] == "--microbatches" else ["--microbatches", "8"] + extra)
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"{PROG}: error: ") and message in err and err.count("\n") == 1


def test_unwritable_json_is_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, *BASE, "--policy", "dfc", "--json", tmp_path / "missing" / "x.json")
    assert code == 2 and err.startswith(f"{PROG}: error: ") and err.count("\n") == 1


def test_module_entry_point():
    ok = subprocess.run([sys.executable, "-m", "megatron_app.sim", *BASE, "--policy", "adaptive"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stderr == "" and "adaptive" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_app.sim", *BASE, "--jitter", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1


def test_split_backward_rows_include_zb_h1_and_adaptive_reaches_its_bound(capsys):
    code, out, err = run_main(capsys, *BASE, "--split-backward")
    rows = table_rows(out)
    assert code == 0 and err == "" and list(rows) == list(policies_for(PipelineShape(4, 2, 8, split_backward=True)))
    # B = W = 10 ms: ZB-H1's closed form (3mV + P - 1) x 10 ms, also the split backward's path bound
    assert rows["zb-h1"]["makespan"] == rows["adaptive"]["makespan"] == rows["adaptive"]["bound"] == 510.0
    assert rows["interleaved"]["makespan"] > 510.0
