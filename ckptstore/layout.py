"""Pure naming of everything in a store: cuts, shards, marks, pointers. No I/O.

A store root looks like this (docs/format.md is the reference)::

    STORE.json                     store identity: {"format": "ckptstore", "format_version": 1}
    LATEST                         the commit point: JSON naming the committed cut and its manifest hash
    cuts/<cut-id>/MANIFEST.json    a committed cut's manifest (written last, deleted first)
    cuts/<cut-id>/<shard>          shard files of that cut
    cuts/<cut-id>/rank<r>.json     a rank's "my files are durable" record (cuts of several ranks)
    marks/<cut-id>.json            in-progress mark: who is writing that cut
    bad/<cut-id>.json              a cut that failed verification on load (never tried again)
    .writer.lock, WRITER.json      the single-writer lock and who holds it

Every name read back from disk (a LATEST target, a manifest's file list) goes through the ``check_*``
functions here, which refuse anything that could leave the store (``..``, ``/``, NUL, odd characters).
"""

from __future__ import annotations

import re
import secrets

from .errors import HostileInput
from .hashing import digest

STORE_FILE = "STORE.json"
LATEST_FILE = "LATEST"
CUTS_DIR = "cuts"
MARKS_DIR = "marks"
BAD_DIR = "bad"
FINAL_DIR = "final"  # final marks: cuts marked final after their commit (Store.mark_final)
LABELS_DIR = "labels"  # labels: names for committed cuts (ckptstore.labels)
MANIFEST_FILE = "MANIFEST.json"
LOCK_FILE = ".writer.lock"
LEASE_FILE = ".writer.lease"  # the object-store writer lease (ckptstore.lock)
WRITER_FILE = "WRITER.json"
TMP_PREFIX = ".tmp-"

#: Everything the store itself may create at the root; anything else there is foreign.
ROOT_ENTRIES = frozenset({STORE_FILE, LATEST_FILE, CUTS_DIR, MARKS_DIR, BAD_DIR, FINAL_DIR, LABELS_DIR, LOCK_FILE,
                          LEASE_FILE, WRITER_FILE})

_CUT_ID = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")
_SHARD = re.compile(r"^rank(\d{5})-(\d{5})\.safetensors(\.zst)?$")
_RANK_RECORD = re.compile(r"^rank(\d{5})\.json$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
MAX_STEP = 10**12 - 1
MAX_WORLD_SIZE = 10**5  # shard and rank-record names carry the rank in 5 digits


def check_step(step: object, **where: str | None) -> int:
    """``step`` if it is an int in [0, MAX_STEP] (a cut id holds it in 12 digits), else a ``UsageError``
    naming the store: the one bound every way of taking a cut applies (issue 20: ``maybe_cut(10**12)``
    raised a raw ValueError, and the bounds differed between save, the Checkpointer, ranked cuts and
    the DCP writer)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        from .errors import UsageError

        raise UsageError(f"step must be an int in [0, {MAX_STEP}], got {step!r:.80}", **where)
    return step


def new_cut_id(step: int) -> str:
    """A fresh cut id: the zero-padded step (readable listings) plus a random token (no collision with
    a crashed earlier attempt at the same step, failure-modes row 6). Order comes from the manifest's
    step, never from this name."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, {MAX_STEP}], got {step}")
    return f"step-{step:012d}-{secrets.token_hex(4)}"


def is_cut_id(name: str) -> bool:
    return _CUT_ID.fullmatch(name) is not None


def step_of_cut_id(cut_id: str) -> int:
    m = _CUT_ID.fullmatch(cut_id)
    if m is None:
        raise HostileInput(f"not a cut id: {cut_id!r}")
    return int(m.group(1))


def check_cut_id(name: str, *, store: str | None = None, path: str | None = None) -> str:
    """Returns ``name`` if it is a well-formed cut id, else raises HostileInput."""
    if not isinstance(name, str) or not is_cut_id(name):
        raise HostileInput(f"refusing cut name {name!r}: not of the form step-<12 digits>-<8 hex>",
                           store=store, path=path)
    return name


def shard_name(rank: int, index: int, *, compressed: bool) -> str:
    return f"rank{rank:05d}-{index:05d}.safetensors" + (".zst" if compressed else "")


def is_plain_file_name(name: str) -> bool:
    """True for a plain file name that stays inside its directory (no ``..``, ``/``, NUL, dot-file)."""
    return (isinstance(name, str) and _SAFE_NAME.fullmatch(name) is not None and ".." not in name
            and name != MANIFEST_FILE and not is_rank_record_name(name))


def check_file_name(name: str, *, store: str | None = None, cut: str | None = None) -> str:
    """Returns ``name`` if it is a plain file name inside a cut directory, else raises HostileInput."""
    if not is_plain_file_name(name):
        raise HostileInput(f"refusing file name {name!r} in manifest: not a plain shard name",
                           store=store, cut=cut, path=str(name))
    return name


def is_shard_name(name: str) -> bool:
    return _SHARD.fullmatch(name) is not None


def shard_rank(name: str) -> int | None:
    """The rank a shard's name carries (None for a name that is no shard's)."""
    m = _SHARD.fullmatch(name)
    return int(m.group(1)) if m else None


def rank_record_name(rank: int) -> str:
    """The name of rank ``rank``'s record in a cut directory of several ranks."""
    if not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank must be in [0, {MAX_WORLD_SIZE}), got {rank}")
    return f"rank{rank:05d}.json"


def is_rank_record_name(name: str) -> bool:
    return _RANK_RECORD.fullmatch(name) is not None


def rank_record_path(cut_id: str, rank: int) -> str:
    return f"{CUTS_DIR}/{cut_id}/{rank_record_name(rank)}"


def cut_dir(cut_id: str) -> str:
    return f"{CUTS_DIR}/{cut_id}"


def cut_file(cut_id: str, name: str) -> str:
    return f"{CUTS_DIR}/{cut_id}/{name}"


def manifest_path(cut_id: str) -> str:
    return f"{CUTS_DIR}/{cut_id}/{MANIFEST_FILE}"


def mark_path(cut_id: str) -> str:
    return f"{MARKS_DIR}/{cut_id}.json"


def bad_path(cut_id: str) -> str:
    return f"{BAD_DIR}/{cut_id}.json"


def final_path(cut_id: str) -> str:
    return f"{FINAL_DIR}/{cut_id}.json"


def cut_id_of_mark(name: str) -> str | None:
    """The cut id a file name in ``marks/`` (or ``bad/``) refers to, or None when it is foreign."""
    if not name.endswith(".json"):
        return None
    stem = name[: -len(".json")]
    return stem if is_cut_id(stem) else None


def tmp_name(final_name: str) -> str:
    """A sibling temp name for a durable write of ``final_name`` (same directory, so rename is atomic
    and never crosses devices, failure-modes row 4)."""
    return f"{TMP_PREFIX}{secrets.token_hex(6)}-{final_name}"


_TMP = re.compile(r"^\.tmp-[0-9a-f]{12}-(.+)$")


def is_tmp_name(name: str) -> bool:
    """Exactly the temp names :func:`tmp_name` makes for the files the store writes durably (a user's
    ``.tmp-notes.txt`` is not ours and is never deleted)."""
    m = _TMP.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return False
    final = m.group(1)
    return (final in ROOT_ENTRIES or final == MANIFEST_FILE or is_rank_record_name(final)
            or cut_id_of_mark(final) is not None or is_label_file_name(final))


_LABEL_FILE = re.compile(r"^[0-9a-f]{32}\.json$")


def label_path(label: str) -> str:
    """``labels/<first 32 hex digits of blake3(label)>.json``: named here with every other name, so a
    crash inside ``Store.label`` leaves a temp name :func:`is_tmp_name` knows (issue 20: it was filed
    as foreign and gc never removed it)."""
    return f"{LABELS_DIR}/{digest(label.encode())[:32]}.json"


def is_label_file_name(name: str) -> bool:
    return _LABEL_FILE.fullmatch(name) is not None
