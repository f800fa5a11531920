"""train/startup.py: a rank's start-up phases, from its process's start (kept in the JSON log as "startup")."""

import subprocess
import sys
import time

from megatron_app.train.startup import ENDING_PHASES, PHASES, TRAINER_PARTS, EndingClock, StartupClock, process_age_s


def test_a_fresh_process_knows_its_age():
    code = ("import time; time.sleep(0.3)\nfrom megatron_app.train.startup import process_age_s\n"
            "print(process_age_s())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=60).stdout)
    assert 0.3 <= age < 10.0


def test_the_phases_are_consecutive_and_sum_to_the_total():
    clock = StartupClock()
    assert clock.report() is None      # nothing marked yet
    for phase in PHASES:
        time.sleep(0.02)
        clock.mark(phase)
    report = clock.report()
    assert list(report["seconds"]) == list(PHASES)
    assert all(seconds >= 0.015 for seconds in list(report["seconds"].values())[1:])
    assert abs(sum(report["seconds"].values()) - report["total_s"]) < 0.01
    assert abs(report["process_started_unix"] + report["total_s"] - time.time()) < 1.0
    assert report["total_s"] >= process_age_s() - 1.0


def test_the_trainers_parts_are_consecutive_and_sum_to_its_phase():
    clock = StartupClock()
    for phase in PHASES[:-1]:
        clock.mark(phase)
    for part in TRAINER_PARTS:
        time.sleep(0.02)
        clock.mark_part(part)
    clock.mark("trainer")
    report = clock.report()
    assert list(report["trainer_parts"]) == list(TRAINER_PARTS)
    assert all(seconds >= 0.015 for seconds in report["trainer_parts"].values())
    assert abs(sum(report["trainer_parts"].values()) - report["seconds"]["trainer"]) < 0.01
    unparted = StartupClock()
    unparted.mark("imports")
    assert "trainer_parts" not in unparted.report()


def test_run_single_s_own_phases_come_from_its_marks():
    from megatron_app.train.startup import launcher_seconds

    assert launcher_seconds("100.0 101.5 104.0", 107.25) == {"setup_env": 1.5, "check_config": 2.5, "to_rank": 3.25}
    assert launcher_seconds(None, 107.0) is None and launcher_seconds("1 2", 3.0) is None
    assert launcher_seconds("a b c", 3.0) is None


def test_the_ending_phases_are_consecutive_and_end_at_the_last_mark():
    clock = EndingClock()
    assert clock.report() is None
    for phase in ENDING_PHASES:
        time.sleep(0.02)
        clock.mark(phase)
    report = clock.report()
    assert list(report["seconds"]) == list(ENDING_PHASES)
    assert all(seconds >= 0.015 for seconds in report["seconds"].values())
    assert abs(report["ended_unix"] - time.time()) < 0.5


def test_without_a_start_gate_nothing_waits():
    from megatron_app.train.start_gate import wait_for_start_gate

    started = time.monotonic()
    assert wait_for_start_gate({}) is False and time.monotonic() - started < 0.1


def test_the_start_gate_holds_the_rank_until_its_file_exists(tmp_path):
    import threading

    from megatron_app.train.start_gate import START_GATE_ENV, wait_for_start_gate

    gate = tmp_path / "gate"
    opener = threading.Timer(0.3, gate.touch)
    opener.start()
    started = time.monotonic()
    assert wait_for_start_gate({START_GATE_ENV: str(gate)}, poll_s=0.01) is True
    assert 0.25 <= time.monotonic() - started < 5.0


def test_a_gate_that_never_opens_or_whose_owner_died_ends_the_wait_with_one_line(tmp_path):
    import pytest

    from megatron_app.train.start_gate import (START_GATE_ENV, START_GATE_OWNER_ENV, START_GATE_TIMEOUT_ENV,
                                               StartGateTimeout, wait_for_start_gate)

    gate = str(tmp_path / "never")
    with pytest.raises(StartGateTimeout, match="did not open within 0.2 s"):
        wait_for_start_gate({START_GATE_ENV: gate, START_GATE_TIMEOUT_ENV: "0.2"}, poll_s=0.01)
    with pytest.raises(StartGateTimeout, match="must be a number of seconds"):
        wait_for_start_gate({START_GATE_ENV: gate, START_GATE_TIMEOUT_ENV: "soon"})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    with pytest.raises(StartGateTimeout, match=f"its owner, process {gone.pid}, is gone"):
        wait_for_start_gate({START_GATE_ENV: gate, START_GATE_OWNER_ENV: str(gone.pid)}, poll_s=0.01)
    assert time.monotonic() - started < 1.0

