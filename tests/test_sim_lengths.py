"""Variable-length microbatches in the simulator: lengths sources, per-microbatch cost and memory, the planned
policy's token cap, the CLI flags, the frontier command and tools/corpus_lengths.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.sim import ComputeCosts, SimConfig, simulate
from megatron_app.sim.cli import main as sim_main
from megatron_app.sim.frontier import main as frontier_main
from megatron_app.sim.lengths import MicrobatchLengths

REPO = Path(__file__).resolve().parents[1]


def test_lengths_are_keyed_by_seed_and_iteration_and_cost_one_at_the_mean():
    lengths = MicrobatchLengths(sigma=0.8)
    assert lengths.draw(16, 3, 1) == lengths.draw(16, 3, 1) != lengths.draw(16, 3, 2)
    assert lengths.cost_factor(lengths.mean_tokens) == pytest.approx(1.0)
    assert lengths.cost_factor(2 * lengths.mean_tokens) == pytest.approx((0.7 * 2 + 0.3 * 4) / 1.0)
    corpus = MicrobatchLengths(corpus=(5, 7, 11, 13))
    assert sorted(corpus.draw(4, 0, 0)) == [5, 7, 11, 13]         # a shuffle when the corpus is large enough
    assert set(corpus.draw(9, 0, 0)) <= {5, 7, 11, 13}


def test_lengths_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nmany\n")
    with pytest.raises(ScheduleConfigError, match="bad.txt:2: expected a token count"):
        MicrobatchLengths.from_file(bad)
    with pytest.raises(ScheduleConfigError, match="cannot read lengths file"):
        MicrobatchLengths.from_file(tmp_path / "missing.txt")
    with pytest.raises(ScheduleConfigError, match="exactly one source"):
        MicrobatchLengths()


def test_planned_is_faster_than_megatrons_order_within_its_token_cap():
    shape = PipelineShape(4, 2, 16)
    costs = ComputeCosts.uniform(shape, 10_000, 20_000)
    for factor in (1.0, 1.25):
        config = SimConfig(shape, costs, lengths=MicrobatchLengths(sigma=1.0), iterations=2, seed=1,
                           memory_factor=factor)
        interleaved, planned = simulate(config, "interleaved"), simulate(config, "planned")
        assert interleaved.peak_tokens_over_megatron == pytest.approx(1.0)
        assert planned.peak_tokens_over_megatron <= factor + 1e-9
        assert planned.makespan_us < interleaved.makespan_us
        assert planned.lower_bound_us == interleaved.lower_bound_us      # same lengths and durations (paired)


def test_sim_cli_variable_lengths_table_and_errors(capsys, tmp_path):
    base = ["--pipeline_parallel", "2", "--model_chunks", "2", "--microbatches", "4"]
    assert sim_main(base + ["--length-sigma", "0.7", "--policy", "planned", "--memory-factor", "1.1"]) == 0
    out = capsys.readouterr().out
    assert "tokens/Megatron" in out and "planned" in out
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# token counts\n30\n300\n3\n90\n")
    assert sim_main(base + ["--lengths-file", str(lengths), "--policy", "interleaved"]) == 0
    assert "1.000" in capsys.readouterr().out
    lengths.write_text("30\n-4\n")
    assert sim_main(base + ["--lengths-file", str(lengths)]) == 2
    err = capsys.readouterr().err
    assert "a length must be >= 1" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        sim_main(base + ["--length-sigma", "1", "--lengths-file", str(lengths)])
    assert "not allowed with" in capsys.readouterr().err


def test_frontier_command_prints_rows(capsys):
    assert frontier_main(["--shapes", "2x2x4", "--sigmas", "0.8", "--factors", "1.0,1.25", "--seeds", "1",
                          "--iterations", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("P=2")]
    assert len(rows) == 2
    assert frontier_main(["--shapes", "2x2"]) == 2


def test_corpus_lengths_tool(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("A short paragraph.\n\nA much longer paragraph with many more words in it, so it "
                                  "gets many more tokens than the first one did.\n")
    (corpus / "b.txt").write_text("Third one.\n")
    out = tmp_path / "lengths.txt"
    tool = REPO / "tools" / "corpus_lengths.py"
    done = subprocess.run([sys.executable, str(tool), "--input-dir", str(corpus), "--output", str(out),
                           "--vocab-size", "300"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    counts = [int(v) for v in out.read_text().split()]
    assert len(counts) == 3 and counts[1] > counts[0] > 0
    bad = subprocess.run([sys.executable, str(tool), "--input-dir", str(tmp_path / "none"), "--output", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
