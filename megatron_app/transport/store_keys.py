"""Keys in the torch.distributed store: waiting for them (one line that says what did not appear), reading JSON."""

from __future__ import annotations

import datetime
import json


def wait_for_keys(store, keys: list[str], timeout_s: float, what: str) -> None:
    """Returns once every key is in `store`; TimeoutError naming `what` after timeout_s seconds."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # c10d raises DistStoreError / RuntimeError subclasses, by version
        raise TimeoutError(f"{what} did not appear in the torch.distributed store within {timeout_s:g} s "
                           f"(is every rank of the job running?): {error}") from None


def read_json(store, key: str):
    """The JSON value a rank published under `key`."""
    return json.loads(store.get(key).decode())
