"""Shard files, written and read back with every byte hashed once as it passes, no torch anywhere: the
one name for the three modules that do it (issue 20 split the 607-line module by side):

* :mod:`ckptstore.shardwrite`: ``plan_shards``, ``file_order``, ``write_shard``, ``write_shards``, ``Codec``;
* :mod:`ckptstore.shardread`: ``read_shard_into`` (streaming), ``read_header``, ``read_tensor_range``;
* :mod:`ckptstore.shardcheck`: a shard against its manifest records, and ``local_digests_v2`` (verify's
  fast path over ``Storage.map_file``).

Every name the store, the writer and the tests import from here keeps working from here.
"""

from __future__ import annotations

from .shardcheck import (
    check_file_digest_v2,
    check_header_matches,
    check_missing,
    check_tensor_digests,
    file_order_key,
    local_digests_v2,
)
from .shardread import MAX_ZSTD_WINDOW, ArraySink, read_header, read_shard_into, read_tensor_range
from .shardwrite import PIECE, Codec, file_order, plan_shards, write_shard, write_shards
from .storage.posix import READ_BUFFER

__all__ = [
    "MAX_ZSTD_WINDOW", "PIECE", "READ_BUFFER", "ArraySink", "Codec", "check_file_digest_v2", "check_header_matches",
    "check_missing", "check_tensor_digests", "file_order", "file_order_key", "local_digests_v2", "plan_shards",
    "read_header", "read_shard_into", "read_tensor_range", "write_shard", "write_shards",
]
