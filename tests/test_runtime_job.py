"""The runtime's per-job context (runtime/job.py): what a job needs lives on its AppJob, not in module globals."""

import ast
import pathlib

import pytest

import megatron_app.runtime as runtime
from megatron_app.runtime.job import AppJob, current_job

RUNTIME = pathlib.Path(runtime.__file__).parent


def test_no_runtime_module_rebinds_a_global_but_the_current_job_holder():
    rebinding = {path.name for path in RUNTIME.glob("*.py")
                 if any(isinstance(node, ast.Global) for node in ast.walk(ast.parse(path.read_text())))}
    assert rebinding == {"job.py"}


def test_what_one_job_is_told_for_its_next_call_stays_with_that_job():
    told, other = AppJob(), AppJob()
    told.next_call.set_lengths([4, 9])
    assert other.next_call.take_lengths(2) is None
    assert told.next_call.take_lengths(2) == (4, 9) and told.next_call.take_lengths(2) is None


def test_the_public_functions_act_on_the_current_job():
    job = current_job()
    runtime.set_microbatch_lengths([3, 5, 7])
    assert job.next_call.lengths == (3, 5, 7)
    assert runtime.take_microbatch_lengths(3) == (3, 5, 7) and job.next_call.lengths is None
    wrapper = lambda transport, ranks: transport  # noqa: E731
    runtime.add_transport_wrapper(wrapper)
    try:
        assert job.transport_wrappers[-1] is wrapper
    finally:
        runtime.remove_transport_wrapper(wrapper)
    assert wrapper not in job.transport_wrappers


def test_shutdown_closes_the_session_and_keeps_the_job():
    job = current_job()
    session = job.session
    runtime.shutdown()
    assert job.open_session is None and session._closed and current_job() is job
    assert runtime.current_tracer() is None


def test_install_keeps_megatron_originals_in_the_jobs_record_and_uninstall_puts_them_back():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    from megatron_app.runtime import linear_wgrad

    before = schedules.forward_backward_pipelining_without_interleaving
    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    linear_before = linear.backward
    job = current_job()
    runtime.install()
    try:
        assert runtime.is_installed() and job.installation.schedule_functions[
            "forward_backward_pipelining_without_interleaving"] is before
        for name, entry_point in runtime.MEGATRON_ENTRY_POINTS.items():   # each with its function's refusals
            assert getattr(schedules, name) is entry_point and entry_point.__name__ == name
        linear_wgrad.install(job.installation)
        assert job.installation.linear_backward is linear_before and linear.backward is not linear_before
    finally:
        runtime.uninstall()
    assert not runtime.is_installed() and job.installation.linear_backward is None
    assert schedules.forward_backward_pipelining_without_interleaving is before and linear.backward is linear_before


@pytest.fixture(autouse=True)
def _closed_session():
    yield
    runtime.shutdown()


def test_each_pipeline_group_gets_its_own_transport_closed_with_the_session(monkeypatch):
    """A call on another pipeline group (an explicit ProcessGroupCollection) gets that group's transport: one per
    set of ranks, opened on its first call, parallel_state's named by the job id and any other by the job id and a
    digest of its ranks; all close with the session."""
    from megatron_app.runtime import session as session_module

    opened = []

    class FakeTransport:
        def __init__(self, job_id, peers):
            self.job_id, self.peers, self.closed = job_id, peers, False

        def close(self):
            self.closed = True

    def fake_open(store, rank, world_size, job_id, peers, **options):
        opened.append(FakeTransport(job_id, list(peers)))
        return opened[-1]

    monkeypatch.setattr(session_module, "agree_on_job_id", lambda requested: "job")
    monkeypatch.setattr("megatron_app.transport.open_transport", fake_open)
    monkeypatch.setattr(session_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(session_module.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(session_module.dist.distributed_c10d, "_get_default_store", lambda: None)
    monkeypatch.setattr(session_module, "_parallel_state_pipeline_ranks", lambda: (0, 2, 4, 6))
    job = AppJob()
    session = job.session
    default, grid = session.ensure_transport([0, 2, 4, 6]), session.ensure_transport([0, 1, 2, 3])
    assert session.ensure_transport([6, 4, 2, 0]) is default and session.ensure_transport([0, 1, 2, 3]) is grid
    assert session.ensure_transport([0]) is None and session.transports == [default, grid] and len(opened) == 2
    assert (default.job_id, default.peers) == ("job", [2, 4, 6]) and grid.peers == [1, 2, 3]
    assert grid.job_id == session_module.transport_job_id("job", (0, 1, 2, 3), (0, 2, 4, 6)) != "job"
    job.close_session()
    assert default.closed and grid.closed


def test_a_groups_transport_id_is_the_same_for_every_member_and_fits_the_wire():
    from megatron_app.runtime.session import MAX_JOB_ID_CHARS, transport_job_id

    assert transport_job_id("j1", (0, 1), (0, 1)) == "j1"
    other = transport_job_id("j1", (0, 2), (0, 1))
    assert other == transport_job_id("j1", (0, 2), None) != transport_job_id("j1", (0, 3), None)
    assert other != transport_job_id("j2", (0, 2), None)
    long_id = "x" * MAX_JOB_ID_CHARS
    assert len(transport_job_id(long_id, (4, 5), None)) <= MAX_JOB_ID_CHARS
    assert transport_job_id(long_id, (4, 5), None) != transport_job_id(long_id + "y", (4, 5), None)


def test_trace_iterations_count_from_one_and_follow_the_loops_number():
    from megatron_app.trace.schema import FIRST_ITERATION

    job = AppJob()
    assert FIRST_ITERATION == 1
    assert [job.trace_iteration(calls) for calls in (0, 1, 2)] == [1, 2, 3]   # untold: calls counted from 1
    job.tell_iteration(4)          # a run resumed after iteration 3: its first call is the log's iteration 4
    assert [job.trace_iteration(calls) for calls in (0, 1)] == [4, 5]
