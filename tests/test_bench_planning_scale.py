"""megatron_app.bench.planning_scale at the small end: a fixed budget, repeated plans after new samples, packed."""

import json
from pathlib import Path

import pytest

from megatron_app.bench.planning_scale import main

LENGTHS = Path(__file__).resolve().parents[1] / "docs" / "results" / "lengths" / "corpus_256.txt"


@pytest.mark.parametrize("composition", ["packed", "balanced"])
def test_repeated_budgeted_plans_report_their_median_time(tmp_path, capsys, composition):
    out = tmp_path / "plan.json"
    assert main(["--pipeline-parallel", "2", "--model-chunks", "2", "--documents", "16", "--lengths-file",
                 str(LENGTHS), "--budget-ms", "1", "--repeats", "3", "--composition",
                 composition, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["budget"], result["repeats"], result["composition"]) == (0.001, 3, composition)
    assert result["planning_cpu_s"] > 0 and result["predicted_iteration_s"] > 0
    assert ("loader's" in capsys.readouterr().out) == (composition == "balanced")   # packed plans no loader baseline
