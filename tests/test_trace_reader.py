"""read_trace_dir: every way a trace directory can be wrong gives a TraceError naming the file and the problem."""

from __future__ import annotations

import json
import re

import pytest

from megatron_app.trace import TraceError, TraceMeta, Tracer, read_trace_dir
from test_trace_synthetic import plan_greedy, write_plan


@pytest.fixture
def good_dir(tmp_path):
    """P=2 V=1 m=2, iterations 0 and 1 complete."""
    return write_plan(tmp_path / "traces", plan_greedy(2, 1, 2, iterations=2))


def rewrite_line(path, lineno, transform):
    lines = path.read_text().split("\n")
    lines[lineno - 1] = transform(lines[lineno - 1])
    path.write_text("\n".join(lines))


def test_good_directory_reads_back(good_dir):
    run = read_trace_dir(good_dir, pipeline_parallel=2, model_chunks=1)
    assert (run.pipeline_parallel, run.model_chunks, run.microbatches, run.source) == (2, 1, 2, "sim")
    assert run.iterations() == [0, 1] and run.complete_iterations() == [0, 1]
    assert run.select_iterations() == [1] and run.select_iterations("all") == [0, 1]
    assert run.select_iterations(0) == [0]
    assert [s.meta.pp_rank for s in run.pipeline_view()] == [0, 1]


def test_newer_minor_version_is_accepted(good_dir):
    rewrite_line(good_dir / "trace_rank1.jsonl", 1,
                 lambda line: json.dumps(json.loads(line) | {"schema_version": "1.99", "new_field": 1}))
    read_trace_dir(good_dir)


@pytest.mark.parametrize("version", ["2.0", "0.9"])
def test_unknown_major_version_is_rejected(good_dir, version):
    rewrite_line(good_dir / "trace_rank1.jsonl", 1,
                 lambda line: json.dumps(json.loads(line) | {"schema_version": version}))
    with pytest.raises(TraceError, match=rf"trace_rank1\.jsonl: schema_version {version} is not supported by "
                                         r"this reader \(it reads 1\.x\)"):
        read_trace_dir(good_dir)


def test_corrupt_line(good_dir):
    rewrite_line(good_dir / "trace_rank0.jsonl", 4, lambda line: line[:10] + "#garbage" + line[10:])
    with pytest.raises(TraceError, match=r"trace_rank0\.jsonl: line 4: corrupt line"):
        read_trace_dir(good_dir)


def test_truncated_file(good_dir):
    path = good_dir / "trace_rank1.jsonl"
    path.write_bytes(path.read_bytes()[:-25])  # the run died mid-write
    with pytest.raises(TraceError, match=r"trace_rank1\.jsonl: line \d+: truncated"):
        read_trace_dir(good_dir)


def test_empty_file(good_dir):
    (good_dir / "trace_rank1.jsonl").write_text("")
    with pytest.raises(TraceError, match=r"trace_rank1\.jsonl: empty file"):
        read_trace_dir(good_dir)


def test_not_a_trace_header(good_dir):
    rewrite_line(good_dir / "trace_rank0.jsonl", 1, lambda line: '{"hello": 1}')
    with pytest.raises(TraceError, match=r"trace_rank0\.jsonl: line 1 is not a trace header"):
        read_trace_dir(good_dir)


def test_missing_rank_file(good_dir):
    (good_dir / "trace_rank1.jsonl").unlink()
    with pytest.raises(TraceError, match=r"missing trace_rank1\.jsonl: no trace for pipeline rank 1"):
        read_trace_dir(good_dir)


def test_trace_from_another_shape(good_dir):
    with pytest.raises(TraceError, match=r"trace_rank0\.jsonl: trace is from a run with pipeline_parallel=2 "
                                         r"\(asked 4\)"):
        read_trace_dir(good_dir, pipeline_parallel=4, model_chunks=1)
    with pytest.raises(TraceError, match=r"model_chunks=1 \(asked 2\)"):
        read_trace_dir(good_dir, pipeline_parallel=2, model_chunks=2)


def test_stale_file_of_another_run(good_dir):
    write_plan(good_dir, plan_greedy(2, 1, 2), ranks=[1], microbatches=4, run_id="older")
    with pytest.raises(TraceError, match=r"trace_rank1\.jsonl: from a different run than trace_rank0\.jsonl "
                                         r"\(microbatches 4 vs 2, run_id 'older' vs ''\)"):
        read_trace_dir(good_dir)


def test_event_with_wrong_rank(good_dir):
    rewrite_line(good_dir / "trace_rank0.jsonl", 2, lambda line: line.replace('"rank":0', '"rank":1', 1))
    with pytest.raises(TraceError, match=r"trace_rank0\.jsonl: line 2: event of rank 1"):
        read_trace_dir(good_dir)


def test_event_with_chunk_outside_the_model(good_dir):
    def bump_chunk(line):
        return re.sub(r'"chunk":0', '"chunk":3', line)
    path = good_dir / "trace_rank0.jsonl"
    lineno = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if '"kind":"forward"' in l)
    rewrite_line(path, lineno, bump_chunk)
    with pytest.raises(TraceError, match=rf"line {lineno}: chunk must be an integer >= 0 and < 1, got 3"):
        read_trace_dir(good_dir)


def test_duplicate_task(good_dir):
    path = good_dir / "trace_rank0.jsonl"
    forward = next(l for l in path.read_text().splitlines() if '"kind":"forward"' in l)
    path.write_text(path.read_text() + forward + "\n")
    with pytest.raises(TraceError, match=r"trace_rank0\.jsonl: line \d+: duplicate forward chunk 0 microbatch 0"):
        read_trace_dir(good_dir)


def test_no_directory_and_no_files(tmp_path):
    with pytest.raises(TraceError, match="trace directory does not exist"):
        read_trace_dir(tmp_path / "nope")
    with pytest.raises(TraceError, match=r"no trace files \(trace_rank<N>\.jsonl\)"):
        read_trace_dir(tmp_path)


def test_incomplete_iterations_are_not_selected(tmp_path):
    plan = plan_greedy(2, 1, 2, iterations=2)
    # rank 1 died during iteration 1: its last backward never happened
    lost = plan.task(1, 1, "backward", 0, 1)
    plan.events.remove(lost)
    run = read_trace_dir(write_plan(tmp_path, plan))
    assert run.complete_iterations() == [0]
    assert run.select_iterations() == [0]
    with pytest.raises(TraceError, match=r"iteration 1 is incomplete: trace_rank1\.jsonl has 1 of 2 backward"):
        run.select_iterations(1)
    with pytest.raises(TraceError, match=r"iteration 7 is not in the trace \(iterations: 0\.\.1\)"):
        run.select_iterations(7)


def test_no_complete_iteration(tmp_path):
    plan = plan_greedy(2, 1, 2, iterations=1)
    plan.events.remove(plan.task(0, 0, "backward", 0, 1))
    run = read_trace_dir(write_plan(tmp_path, plan))
    with pytest.raises(TraceError, match=r"no complete iteration \(trace_rank0\.jsonl has 1 of 2 backward"):
        run.select_iterations()


def test_tensor_and_data_parallel_coverage(tmp_path):
    """With tp/dp sizes in the headers, every (pp, tp, dp) file must be there."""
    def write(global_rank, pp, tp, dp):
        Tracer(tmp_path, TraceMeta(global_rank=global_rank, pp_rank=pp, tp_rank=tp, dp_rank=dp,
                                   pipeline_parallel=2, model_chunks=1, microbatches=1, tensor_parallel=2,
                                   data_parallel=1)).close()
    write(0, 0, 0, 0)
    write(1, 0, 1, 0)
    write(2, 1, 0, 0)
    with pytest.raises(TraceError, match=r"missing trace_rank3\.jsonl: no trace for pp1/tp1/dp0"):
        read_trace_dir(tmp_path)
    write(3, 1, 1, 0)
    run = read_trace_dir(tmp_path)
    assert [[r.meta.global_rank for r in p] for p in run.pipelines()] == [[0, 2], [1, 3]]
    assert [r.meta.global_rank for r in run.pipeline_view()] == [0, 2]
