"""megatron_app: an adaptive pipeline schedule and tensor transport for Megatron-Core."""

__version__ = "0.1.0"


def install(*args, **kwargs):
    """Make Megatron-Core's get_forward_backward_func() return megatron_app's schedule (see runtime.install)."""
    from megatron_app.runtime import install as _install

    return _install(*args, **kwargs)


def uninstall():
    """Restore Megatron-Core's own schedules."""
    from megatron_app.runtime import uninstall as _uninstall

    _uninstall()
