"""schedule/action_lists.py: torch.distributed.pipelining's per-rank action lists as our static orders. torch's
Interleaved1F1B lists are Megatron's order; its InterleavedZeroBubble lists complete, reach ZB-H1's makespan and
hold 8 activations per rank; malformed, misplaced, incomplete or hanging lists are refused in one line, by the
trainer too (--schedule-file)."""

import pytest

from megatron_app.bench.torch_action_lists import action_lists, main as write_csv
from megatron_app.schedule import PipelineShape, ScheduleConfigError, drive, make_policy
from megatron_app.schedule.action_lists import make_action_list_policy, orders_from_action_lists
from megatron_app.schedule.megatron_order import megatron_order


WHOLE, SPLIT = PipelineShape(4, 2, 8), PipelineShape(4, 2, 8, split_backward=True)


def makespan(shape, policies):
    finish = {}
    drive(shape, policies, task_duration=lambda rank, task: 1.0, finish_times=finish)
    return max(finish.values())


def test_torchs_interleaved_1f1b_lists_are_megatrons_order():
    lists = action_lists("Interleaved1F1B", 4, 2, 8)
    assert orders_from_action_lists(WHOLE, lists) == tuple(megatron_order(WHOLE, r) for r in range(4))


def test_torchs_zero_bubble_lists_reach_zb_h1s_makespan_at_8_activations_per_rank():
    lists = action_lists("InterleavedZeroBubble", 4, 2, 8)
    torch_zb = [make_action_list_policy(SPLIT, rank, lists) for rank in range(4)]
    ours = [make_policy("zb-h1", SPLIT, rank) for rank in range(4)]
    assert makespan(SPLIT, torch_zb) == makespan(SPLIT, ours) == 3 * 8 * 2 + 3     # (3mV + P - 1) task-times
    assert [p.memory_cap for p in torch_zb] == [8, 8, 8, 8]
    assert [p.memory_cap for p in ours] == [11, 10, 9, 8]


def test_a_whole_backward_action_runs_b_then_its_w_under_a_split_backward():
    lists = action_lists("Interleaved1F1B", 2, 1, 2)     # 0F0 0F1 0B0 0B1 / 1F0 1B0 1F1 1B1
    shape = PipelineShape(2, 1, 2, split_backward=True)
    order = orders_from_action_lists(shape, lists)[1]
    assert [f"{t.kind.value}{t.microbatch}" for t in order][:3] == ["F0", "B0", "W0"]


@pytest.mark.parametrize("edit, message", [
    (lambda rows: [["0X0", *rows[0][1:]], *rows[1:]], "action '0X0' is not '<stage><F|I|W|B><microbatch>'"),
    (lambda rows: [["1F0", *rows[0][1:]], *rows[1:]], "rank 0's action '1F0': stage 1 is not on rank 0"),
    (lambda rows: [["0F9", *rows[0][1:]], *rows[1:]], "microbatch 9 is outside 0..7"),
    (lambda rows: [rows[0][1:], *rows[1:]], "rank 0's actions must hold each of its 48 tasks once: missing"),
    (lambda rows: [[*rows[0], "0F1"], *rows[1:]], "twice"),
    (lambda rows: rows[:3], "need one action list per pipeline rank \\(4\\), got 3"),
])
def test_malformed_lists_are_refused_in_one_line(edit, message):
    lists = [list(row) for row in action_lists("InterleavedZeroBubble", 4, 2, 8)]
    with pytest.raises(ScheduleConfigError, match=message):
        orders_from_action_lists(SPLIT, edit(lists))


def test_split_actions_need_a_split_backward_and_hanging_lists_are_refused():
    with pytest.raises(ScheduleConfigError, match="splits the backward: run with --split-backward"):
        orders_from_action_lists(WHOLE, action_lists("InterleavedZeroBubble", 4, 2, 8))
    shape = PipelineShape(2, 1, 1)
    with pytest.raises(ScheduleConfigError, match="cannot complete: run together, every rank would wait"):
        orders_from_action_lists(shape, [["0B0", "0F0"], ["1F0", "1B0"]])   # rank 0 waits for its own F's B


def test_the_tool_writes_the_csv_and_the_trainer_checks_it(tmp_path, capsys):
    from megatron_app.train.args import UsageError, parse_args

    path = tmp_path / "zb.csv"
    assert write_csv(["-P", "2", "-V", "2", "-m", "4", "--out", str(path)]) == 0
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    flags = ["--pipeline_parallel", "2", "--model_chunks", "2", "--global-batch-size", "8", "--micro-batch-size",
             "2", "--schedule-file", str(path)]
    assert parse_args([*flags, "--split-backward"], env).schedule_file == str(path)
    with pytest.raises(UsageError, match="--schedule-file .*: .*splits the backward: run with --split-backward"):
        parse_args(flags, env)
    with pytest.raises(UsageError, match="--schedule-file replaces the schedule: drop --schedule interleaved"):
        parse_args([*flags, "--split-backward", "--schedule", "interleaved"], env)
    with pytest.raises(UsageError, match="cannot read schedule file .*missing.csv"):
        parse_args([*flags[:-1], str(tmp_path / "missing.csv"), "--split-backward"], env)
