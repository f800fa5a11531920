"""megatron_app: an adaptive pipeline schedule and tensor transport for Megatron-Core."""

__version__ = "0.1.0"


def install(*args, **kwargs):
    """Make Megatron-Core's get_forward_backward_func() return megatron_app's schedule (see runtime.install), and
    let an uncaught refusal of ours (AppConfigError: a misbuilt model, a bad argument) end the script in one line
    naming the rank and the fix, not a traceback (runtime/one_line_errors.py)."""
    from megatron_app.runtime import install as _install
    from megatron_app.runtime.one_line_errors import install_excepthook

    install_excepthook()
    return _install(*args, **kwargs)


def uninstall():
    """Restore Megatron-Core's own schedules."""
    from megatron_app.runtime import uninstall as _uninstall

    _uninstall()
