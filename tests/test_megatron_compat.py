"""megatron_compat: the supported range, the version check in install(), and the adapters, on the installed
megatron-core (tools/run_tests.sh also runs this file under 0.19.2)."""

import inspect
from pathlib import Path

import pytest
from packaging.version import Version

import megatron_app
from megatron_app import megatron_compat
from megatron_app.megatron_compat import ALLOW_UNTESTED_ENV, UnsupportedMegatronError


@pytest.mark.parametrize("version,supported", [
    ("0.15.3", False), ("0.16.0", True), ("0.16.1", True), ("0.17.1", True), ("0.19.2", True),
    ("0.19.2+4837586", True), ("0.20.0rc0", False), ("0.20.0", False), ("1.0.0", False)])
def test_supported_range(version, supported):
    assert megatron_compat.is_supported(Version(version)) is supported


def test_installed_megatron_core_is_in_range():
    assert megatron_compat.is_supported(megatron_compat.megatron_core_version())


def test_install_refuses_an_untested_megatron_core_in_one_line(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(megatron_compat, "megatron_core_version", lambda: Version("0.21.0"))
    with pytest.raises(UnsupportedMegatronError) as refused:
        megatron_app.install(tracing=False)
    message = str(refused.value)
    assert "\n" not in message and "0.21.0" in message and ALLOW_UNTESTED_ENV in message
    assert not megatron_app.runtime.is_installed()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_override_lets_an_untested_version_through(monkeypatch, how):
    monkeypatch.setattr(megatron_compat, "megatron_core_version", lambda: Version("0.21.0"))
    if how == "environment":
        monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
        megatron_app.install(tracing=False)
    else:
        monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
        megatron_app.install(tracing=False, allow_untested_megatron=True)
    try:
        assert megatron_app.runtime.is_installed()
    finally:
        megatron_app.uninstall()


def test_install_from_args_flag_reaches_the_check(monkeypatch):
    import argparse

    from megatron_app.runtime import add_arguments, install_from_args

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(megatron_compat, "megatron_core_version", lambda: Version("0.21.0"))
    parser = add_arguments(argparse.ArgumentParser())
    with pytest.raises(UnsupportedMegatronError):
        install_from_args(parser.parse_args(["--use-app"]))
    install_from_args(parser.parse_args(["--use-app", "--app-allow-untested-megatron"]))
    megatron_app.uninstall()


@pytest.mark.parametrize("vocab_size", [128, 1024])
def test_null_tokenizer_has_the_whole_vocabulary_and_eod_last(vocab_size):
    tokenizer = megatron_compat.null_tokenizer(vocab_size)
    assert tokenizer.vocab_size == vocab_size and tokenizer.eod == vocab_size - 1


def test_backward_step_adapter_calls_the_installed_signature(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    calls = []

    def old_style(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        calls.append(("0.16", model_type))

    def new_style(input_tensor, output_tensor, output_tensor_grad, config):
        calls.append(("0.17+", config))

    for fake in (old_style, new_style):
        monkeypatch.setattr(schedules, "backward_step", fake)
        megatron_compat._backward_step_takes_model_type.cache_clear()
        megatron_compat.backward_step("in", "out", "grad", "MODEL_TYPE", "CONFIG")
    megatron_compat._backward_step_takes_model_type.cache_clear()
    assert calls == [("0.16", "MODEL_TYPE"), ("0.17+", "CONFIG")]


def test_the_real_backward_step_matches_what_the_adapter_detects():
    from megatron.core.pipeline_parallel import schedules

    params = list(inspect.signature(schedules.backward_step).parameters)
    expected = ["input_tensor", "output_tensor", "output_tensor_grad", "config"]
    if megatron_compat._backward_step_takes_model_type():
        expected.insert(3, "model_type")
    assert params == expected


def test_no_module_outside_megatron_compat_branches_on_the_megatron_version():
    from pathlib import Path

    package = Path(megatron_app.__file__).parent
    offenders = [str(path.relative_to(package)) for path in package.rglob("*.py")
                 if path.name != "megatron_compat.py"
                 and ("package_info" in path.read_text() or "megatron_core_version() <" in path.read_text())]
    assert offenders == []


def test_your_loop_page_lists_exactly_the_flags_add_arguments_adds():
    import argparse
    import re

    from megatron_app.runtime import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    flags = {action.option_strings[0] for action in parser._actions if action.option_strings[0] != "-h"}
    page = (Path(__file__).resolve().parents[1] / "docs" / "your-loop.md").read_text()
    paragraph = page[page.index("`megatron_app.runtime.add_arguments(parser)`"):page.index("`install_from_args(args)`")]
    assert set(re.findall(r"--(?:use-app|app-[a-z-]+)", paragraph)) == flags
