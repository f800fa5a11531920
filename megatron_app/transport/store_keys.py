"""Waiting for keys in the torch.distributed store, with one line that says what did not appear."""

from __future__ import annotations

import datetime


def wait_for_keys(store, keys: list[str], timeout_s: float, what: str) -> None:
    """Returns once every key is in `store`; TimeoutError naming `what` after timeout_s seconds."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # c10d raises DistStoreError / RuntimeError subclasses, by version
        raise TimeoutError(f"{what} did not appear in the torch.distributed store within {timeout_s:g} s "
                           f"(is every rank of the job running?): {error}") from None
