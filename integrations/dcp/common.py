"""What the DCP writer and reader share: their store options and DCP's completed futures."""

from __future__ import annotations

from typing import Any

from torch.futures import Future

from ckptstore import StoreOptions, UsageError


def store_options(options: StoreOptions | None, storage_options: dict[str, Any] | None) -> StoreOptions:
    """The ``StoreOptions`` of a writer or reader given ``options=`` or fsspec ``storage_options=``."""
    if options is not None and storage_options is not None:
        raise UsageError("pass storage_options inside options= or alone, not both")
    if options is None:
        return StoreOptions(storage_options=storage_options)
    return options


def done(value: Any) -> Future:
    """A future that already holds ``value`` (DCP's ``write_data``/``read_data`` return one)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


__all__ = ["done", "store_options"]
