"""What the backend's bootstrap reads from the group's c10d store, failing as a commd StoreError.

A rank that never reaches the backend's creation (crashed, or hangs before
``init_process_group`` / ``new_group``) leaves the others waiting on its key in the
store until the store's timeout.  torch's stores then raise a bare "timeout waiting
for key" (a RuntimeError from a FileStore, a DistStoreError from a TCPStore); this
names the ranks that never wrote their part and what it was, as a StoreError (a
``torch.distributed.DistStoreError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from commd.client.errors import CommdError, StoreError


def read_from_ranks(store: dist.Store, key_of: Callable[[int], str], ranks: Sequence[int], what: str,
                    timeout: float | None = None) -> list[bytes]:
    """The value each of ``ranks`` wrote under ``key_of(rank)``, waiting for it as the store does,
    or at most ``timeout`` seconds for all of them.

    ``what``: what the ranks write ("their node name"), for the error."""
    values: list[bytes] = []
    for rank in ranks:
        try:
            if timeout is not None:
                store.wait([key_of(rank)], timedelta(seconds=timeout))
            values.append(store.get(key_of(rank)))
        except CommdError:
            raise
        except RuntimeError as exc:  # torch's store errors: DistStoreError, DistNetworkError, RuntimeError
            raise StoreError(f"commd bootstrap: {_absent(store, key_of, ranks)} did not write {what} to the "
                             f"c10d store (waited {_timeout_s(store) if timeout is None else f'{timeout:.1f}s'}): {exc}") from exc
    return values


def _absent(store: dist.Store, key_of: Callable[[int], str], ranks: Sequence[int]) -> str:
    """'ranks [1, 3]' whose keys are not in the store, or 'some ranks' where the store cannot say."""
    try:
        missing = [r for r in ranks if not store.check([key_of(r)])]
    except RuntimeError:
        return "some ranks"
    return f"ranks {missing}" if missing else "some ranks"


def _timeout_s(store: dist.Store) -> str:
    try:
        return f"{store.timeout.total_seconds():.1f}s"
    except (AttributeError, RuntimeError):
        return "unknown"
