"""The policy registry is the one list of policies: flag choices, settings validation, the simulator, the benchmark
and the README table all come from it."""

import re
from pathlib import Path

import pytest

from megatron_app.schedule import (ADAPTIVE_POLICY_NAMES, POLICIES, POLICY_NAMES, STATIC_POLICY_NAMES, PipelineShape,
                                   ScheduleConfigError, make_policy, policies_for)

RUNNING = Path(__file__).resolve().parents[1] / "docs" / "running.md"   # the page with the policy table


def readme_policy_table() -> str:
    """docs/running.md's policy table as the registry says it should read."""
    lines = ["| policy | chosen with | what it does |", "|---|---|---|"]
    for name, entry in POLICIES.items():
        flag = f"`--schedule {name}`" if entry.static else f"`--policy {name}`"
        lines.append(f"| `{name}` | {flag} | {entry.summary} |")
    return "\n".join(lines)


def test_readme_policy_table_matches_the_registry():
    text = RUNNING.read_text()
    match = re.search(r"<!-- policies: begin.*?-->\n(.*?)\n<!-- policies: end -->", text, re.S)
    assert match, "docs/running.md has no <!-- policies: begin --> ... <!-- policies: end --> block"
    assert match.group(1).strip() == readme_policy_table(), "regenerate the table:\n" + readme_policy_table()


def test_every_registered_policy_builds_and_unknown_names_say_which_exist():
    shape = PipelineShape(3, 2, 6)
    for name in policies_for(shape):
        policy = make_policy(name, shape, 1)
        assert policy.name == name
    with pytest.raises(ScheduleConfigError, match="choose one of " + ", ".join(POLICY_NAMES)):
        make_policy("nope", shape, 0)
    assert "1f1b" not in policies_for(shape) and "1f1b" in policies_for(PipelineShape(3, 1, 6))
    assert set(ADAPTIVE_POLICY_NAMES) | set(STATIC_POLICY_NAMES) == set(POLICY_NAMES)


def test_flags_settings_and_benchmark_read_the_registry():
    from megatron_app.runtime.settings import ADAPTIVE_POLICIES, SCHEDULES, AppConfigError, AppSettings
    from megatron_app.train.args import POLICIES as TRAIN_POLICIES
    from megatron_app.train.args import SCHEDULES as TRAIN_SCHEDULES

    assert ADAPTIVE_POLICIES == ADAPTIVE_POLICY_NAMES == TRAIN_POLICIES
    # "file" (a schedule file's action lists) is the trainer's --schedule-file, not a --schedule choice
    assert set(SCHEDULES) == {"app", *STATIC_POLICY_NAMES, "file"}
    assert set(TRAIN_SCHEDULES) == {*SCHEDULES, "megatron"} - {"file"}
    for name in ADAPTIVE_POLICY_NAMES:
        AppSettings(policy=name).validate()
    for name in STATIC_POLICY_NAMES:
        split = POLICIES[name].split_only
        assert AppSettings(schedule=name, split_backward=split).validate().policy_name == name
        if split:
            with pytest.raises(AppConfigError, match=f"schedule '{name}' needs --split-backward"):
                AppSettings(schedule=name).validate()
    with pytest.raises(AppConfigError):
        AppSettings(policy="nope").validate()
    from megatron_app.bench.schedule.rows import SCHEDULES as BENCH_ROWS

    assert set(POLICY_NAMES) <= set(BENCH_ROWS)


def test_every_entry_point_defaults_to_the_registry_default():
    import argparse
    import inspect

    from megatron_app.runtime.install import add_arguments, install
    from megatron_app.runtime.settings import AppSettings
    from megatron_app.schedule import DEFAULT_POLICY
    from megatron_app.train.args import build_parser

    assert DEFAULT_POLICY == "planned" and DEFAULT_POLICY in ADAPTIVE_POLICY_NAMES
    assert AppSettings().policy == DEFAULT_POLICY
    from megatron_app.train.args import parse_args

    assert build_parser().get_default("policy") is None   # unset, so a static schedule can refuse a given one
    assert parse_args([], environ={"WORLD_SIZE": "1"}).policy == DEFAULT_POLICY
    assert add_arguments(argparse.ArgumentParser()).get_default("app_policy") == DEFAULT_POLICY
    assert inspect.signature(install).parameters["policy"].default == DEFAULT_POLICY


def test_a_policys_options_are_declared_in_its_entry_and_checked_there():
    from megatron_app.schedule import ScheduleConfigError, make_policy
    from megatron_app.schedule.policies import policies_taking

    assert policies_taking("memory_factor") == ("planned", "planned-fixed")
    shape = PipelineShape(2, 2, 4)
    assert make_policy("planned", shape, 0, memory_factor=1.5).memory_factor == 1.5
    assert make_policy("dfc", shape, 0, memory_factor=None).name == "dfc"     # unset options are not passed
    with pytest.raises(ScheduleConfigError, match="memory_factor applies to policy 'planned' or 'planned-fixed' only, "
                                                  "not 'dfc'"):
        make_policy("dfc", shape, 0, memory_factor=1.5)
    with pytest.raises(ScheduleConfigError, match="memory factor must be a number >= 1"):
        make_policy("planned", shape, 0, memory_factor=0.5)


def test_no_policy_name_is_compared_as_a_string_outside_the_registry():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "megatron_app"
    names = "|".join(re.escape(name) for name in POLICY_NAMES)
    comparison = re.compile(rf"""[=!]=\s*["']({names})["']|["']({names})["']\s*[=!]=""")
    offenders = [f"{path.relative_to(root.parent)}:{number}"
                 for path in root.rglob("*.py") if path.name != "policies.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if comparison.search(line)]
    assert offenders == []
