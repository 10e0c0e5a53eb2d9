"""ckptstore as a storage backend of ``torch.distributed.checkpoint`` (DCP); ``ckptstore.dcp`` before
issue 20 (that path still works for one release, with a ``DeprecationWarning``).

``dcp.save(state_dict, storage_writer=StoreWriter(url, step=step))`` writes one ordinary cut of the
store (every rank's chunks as that rank's shards) and returns once it is committed;
``dcp.load(state_dict, storage_reader=StoreReader(url, cut="latest"))`` reads it back at any world
size (DCP's planner reshards; this reader only hands it the saved chunks, verified). docs/dcp.md has
the whole story.

- :mod:`.writer`: ``StoreWriter`` (the coordinator marks and commits the cut, every rank writes its part).
- :mod:`.reader`: ``StoreReader`` (DCP cuts and native cuts alike).
- :mod:`.metadata`: DCP ``Metadata`` to and from the typed JSON in ``metadata["ckptstore.dcp"]``.
- :mod:`.native`: ``Metadata`` synthesized from the trees of a native cut (``Store.save``, the ``Checkpointer``).
- :mod:`.checks`: what ``verify`` says about a DCP cut (its byte-IO items), no torch.

Importing this package registers the verify check and imports no torch; torch comes with the first
name that needs it (``StoreWriter``, ``StoreReader``, ...). ``ckptstore verify`` imports only
:mod:`.checks` (``ckptstore.integrations.METADATA_CHECKS``), so it runs without torch on DCP cuts too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .checks import METADATA_KEY

#: Each public name of a torch-using module, by that module: loaded on first use (PEP 562).
_LAZY = {
    "StoreWriter": ".writer", "CutPlan": ".writer",
    "StoreReader": ".reader",
    "ArrayLocation": ".metadata", "metadata_to_json": ".metadata", "metadata_from_json": ".metadata",
    "array_name": ".metadata",
    "NativeValue": ".native", "native_metadata": ".native",
}

if TYPE_CHECKING:  # the names for type checkers and editors; at run time __getattr__ loads them
    from .metadata import ArrayLocation, array_name, metadata_from_json, metadata_to_json
    from .native import NativeValue, native_metadata
    from .reader import StoreReader
    from .writer import CutPlan, StoreWriter


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["StoreWriter", "StoreReader", "CutPlan", "ArrayLocation", "NativeValue", "native_metadata", "METADATA_KEY",
           "metadata_to_json", "metadata_from_json", "array_name"]
