"""Deprecated: the DCP adapter moved to :mod:`ckptstore.integrations.dcp` (issue 20: the store layer
knows nothing of DCP). This module re-exports its names for one release and warns on import."""

from __future__ import annotations

import warnings

from ckptstore.integrations.dcp import (
    METADATA_KEY,
    ArrayLocation,
    CutPlan,
    NativeValue,
    StoreReader,
    StoreWriter,
    array_name,
    metadata_from_json,
    metadata_to_json,
    native_metadata,
)
from ckptstore.integrations.dcp.metadata import DCP_VERSION, METADATA_FORMAT_VERSION

warnings.warn("ckptstore.dcp is deprecated: import ckptstore.integrations.dcp (the same names)",
              DeprecationWarning, stacklevel=2)

__all__ = ["StoreWriter", "StoreReader", "CutPlan", "ArrayLocation", "NativeValue", "native_metadata", "METADATA_KEY",
           "metadata_to_json", "metadata_from_json", "array_name", "DCP_VERSION", "METADATA_FORMAT_VERSION"]
