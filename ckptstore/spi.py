"""The service interface: what ``ckptstore.writer`` and ``ckptstore.integrations`` may use of a store
beyond its user API (issue 20). One module they import instead of a score of store modules, so
:class:`~ckptstore.store.Store`'s public face is the user's only.

Each function takes an open :class:`~ckptstore.store.Store`:

- :func:`lock_handoff`: the writer lock as a helper process inherits it.
- :func:`rank_part`: a rank's share of a cut its coordinator marked (a writer's or a participant's, never
  a reader's: a reader writes nothing, rank parts included).
- :func:`shard_spec`, :func:`shard_codec`: the store's shard settings, as a write request carries them,
  and the codec they name.
- :func:`classify`: what is on disk now (committed cuts, leftovers, LATEST's health), for the CLI, resume
  and audits.
- :func:`point_latest`, :func:`record_bad`: the resume tooling's two changes to a store.
- :func:`open_participant`: a handle that writes rank parts of cuts a coordinator elsewhere marks (DCP's
  ranks), holding no lock and committing nothing.
- :func:`mirror_cut`, :func:`missing`, :func:`mirror_missing`: a committed cut copied into another store
  byte for byte, through that store's protocol (:mod:`ckptstore.mirroring`, issue 21), for the writer
  process's uploads; ``MirrorReport`` and ``MirrorConflict`` with them.
- :func:`mirror_rank`: one rank's share of mirroring a cut of several ranks (its own files, its rank
  record; rank 0 also marks and commits) through the mirror's storage-side two-phase commit
  (:mod:`ckptstore.mirroring_ranks`, issue 21).

The old ``Store`` methods of these names (``rank_part_for`` for ``rank_part`` with a rank) still work for
one minor release, with a ``DeprecationWarning``.

Below them, the store's parts the writer and the integrations build on, re-exported here so that they
import this module (and ``ckptstore``'s user API, and ``ckptstore.errors``) and no other store module
(tests/test_layering.py holds them to it): the records of a cut (``CutIntent``, ``ShardSpec``,
``PendingCut``, ``RankPart``, the manifest's records), the state tree and its arrays, the shard
streams, the storage seam's spec, the ranks and the ``Collective`` runner, the commit protocol and the
rescue a writer process runs, the lock a writer process inherits, and verify's notice hook.
"""

from __future__ import annotations

from typing import Any

from . import assemble, cutting, layout, opening, reading, repairing
from .arrays import ArrayItem, describe, empty_for, torch_dtype_name
from .attached import AttachedFile, FilesArg, Source, close_sources, open_sources
from .collective import Collective
from .events import Emitter
from .format import TORCH_DTYPES
from .gcpause import pausing
from .info import CutInfo
from .intent import CutIntent, ShardSpec
from .kinds import StrKind
from .lock import InheritedLock
from .jsontext import remember_tree_text, tree_text
from .manifest import FileRecord, Manifest, TensorRecord
from .records import TensorColumns
from .metachecks import NoticeKind
from .metachecks import register as register_metadata_check
from .mirroring import MirrorConflict, MirrorReport, mirror_cut, mirror_missing, missing
from .mirroring_ranks import mirror_rank
from .models import StrictModel
from .options import StoreOptions
from .pending import PendingCut, RankPart
from .protocol import CommitProtocol
from .ranks import RankFailure, RankGroup, check_all_ok, check_same, outcome
from .reading import rank_manifest
from .rescue import ensure_marked, finish_orphaned_cut
from .retention import Policy, policy_from_json, policy_to_json
from .pointed import read_or_none
from .shards import check_header_matches, read_header, read_shard_into, read_tensor_range, write_shards
from .storage import Storage, StorageSpec, open_spec
from .tree import Leaf, flatten, has_pickle, unflatten
from .tree.layoutcache import Flat, LayoutCache
from .recovery import Classification
from .shards import Codec
from .store import Store, core_of


def lock_handoff(store: Store) -> tuple[dict[str, Any], int | None]:
    """The writer lock as a helper process inherits it (``ckptstore.lock.InheritedLock``): a
    description and, for a flock, the descriptor to pass along (a handle that holds none: kind "none")."""
    return cutting.lock_handoff(core_of(store))


def rank_part(store: Store, cut: str, step: int, rank: int | None = None, world_size: int | None = None) -> RankPart:
    """Rank ``rank``'s share of cut ``cut`` of ``world_size`` ranks (default: the store's group's rank
    and size), marked by the coordinator. A reader's is a ``UsageError``."""
    core = core_of(store)
    if rank is None and world_size is None:
        return cutting.group_rank_part(core, cut, step)
    assert rank is not None and world_size is not None
    return cutting.rank_part(core, cut, step, rank, world_size)


def shard_spec(store: Store) -> ShardSpec:
    """How the store's shards are written (its options, read in one place)."""
    return ShardSpec.of(store.options)


def shard_codec(store: Store) -> Codec:
    """The codec the store's shards are written with (``shard_spec(store).make_codec()``)."""
    return cutting.shard_codec(core_of(store))


def commit_record(store: Store, cut: Any = "latest") -> Manifest:
    """The manifest of a committed cut as it is stored: of a cut of format 5 its commit record alone
    (no fragment read; ``part_of`` reads one rank's part, ``whole_of`` all), else the whole manifest."""
    return reading.manifest(core_of(store), cut)


def part_of(store: Store, m: Manifest, rank: int) -> Manifest:
    """Rank ``rank``'s part of committed cut ``m`` (one fragment read for a cut of format 5)."""
    core = core_of(store)
    return rank_manifest(m, rank, core.url, core.storage, core.parts)


def whole_of(store: Store, m: Manifest) -> Manifest:
    """Committed cut ``m`` with every rank's part in it (every fragment read for a cut of format 5)."""
    core = core_of(store)
    return assemble.whole(core.storage, core.url, m)


def classify(store: Store) -> Classification:
    """What is on disk right now (see :mod:`ckptstore.recovery`)."""
    return core_of(store).classify()


def point_latest(store: Store, cut: str) -> CutInfo:
    """Moves LATEST to committed cut ``cut`` (a fallback resume); writers only."""
    return repairing.point_latest(core_of(store), cut)


def record_bad(store: Store, cut: str, reason: str) -> None:
    """Records committed cut ``cut`` as bad (a resume found it unreadable). Readers too: ``bad/`` is only
    ever added to, and a reader's fallback records what it skipped."""
    repairing.record_bad(core_of(store), cut, reason)


def open_participant(url: Any, options: StoreOptions | None = None) -> Store:
    """A handle that writes rank parts into cuts a coordinator elsewhere marks and commits: role
    participant, no group, no lock, no recovery; ``begin_cut``, ``save``, ``prune``, ``gc`` and the other
    writes raise ``UsageError``."""
    return Store(opening.open_participant(url, options))


__all__ = [
    # the store's plumbing, as functions of an open Store
    "classify", "commit_record", "part_of", "whole_of", "lock_handoff", "open_participant", "point_latest", "rank_part", "record_bad", "shard_codec",
    "shard_spec",
    # a cut's records
    "CutIntent", "PendingCut", "RankPart", "ShardSpec", "CutInfo", "FileRecord", "Manifest", "TensorRecord", "TensorColumns",
    "AttachedFile", "FilesArg", "Source", "open_sources", "close_sources", "Policy", "policy_from_json",
    "policy_to_json", "read_or_none", "remember_tree_text", "tree_text",
    # the state tree and its arrays
    "Leaf", "flatten", "unflatten", "has_pickle", "ArrayItem", "describe", "empty_for", "torch_dtype_name",
    "TORCH_DTYPES", "Flat", "LayoutCache",
    # shards, storage, the protocol, the rescue, the inherited lock
    "write_shards", "read_header", "read_shard_into", "read_tensor_range", "check_header_matches", "Storage",
    "StorageSpec", "open_spec", "CommitProtocol", "ensure_marked", "finish_orphaned_cut", "InheritedLock",
    # ranks
    "Collective", "RankFailure", "RankGroup", "check_all_ok", "check_same", "outcome",
    # the rest
    "Emitter", "pausing", "StrictModel", "StrKind", "NoticeKind", "register_metadata_check", "layout",
    # mirroring (issue 21)
    "mirror_cut", "missing", "mirror_missing", "MirrorReport", "MirrorConflict", "mirror_rank",
]
