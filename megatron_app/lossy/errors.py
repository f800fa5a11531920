"""The loss layer's user-facing error."""


class LossConfigError(ValueError):
    """A bad loss-layer setting; the message is one line meant for the user."""
