"""Writes a golden store: a tiny, fully deterministic ckptstore store checked into tests/golden/v<N>/.

    python tests/golden/make_golden.py            # writes tests/golden/v<N>/, N = the manifest
                                                  # format_version this ckptstore writes for a cut of
                                                  # one rank (refuses to overwrite an existing
                                                  # directory without --force)
    python tests/golden/make_golden.py --ranks    # writes tests/golden/v<M>/, M = the format_version
                                                  # of a cut of several ranks (5: a commit record and
                                                  # one fragment per rank); --force as above

The golden stores pin the on-disk format: tests/store/test_golden.py checks that each one verifies
and loads to ``golden_states()``, and that writing the same states with the same identity today gives
byte-identical shards and manifests to the checked-in ``v<current>`` store (so the bytes of the
current format can never drift silently).

Identity is fixed so the bytes are reproducible: cut ids, ``created_at``, writer host "golden", pid 1,
ckptstore_version "golden". The store is built with the lower-level functions (``write_shard(s)``,
``Manifest(...).to_bytes()``, ``Pointer``) rather than ``Store.save``, which would draw a random cut id
and stamp the clock, host and pid. No lock files and no ``.tmp-*`` files are left behind.

Two cuts: step 7 (two uncompressed shards: tensors of several dtypes, an odd-sized one, 4096-byte
multiples, a zero-size one, a dtype safetensors cannot name, numpy arrays and plain values) and step 8
(one zstd-compressed shard); LATEST names step 8.

With ``--ranks`` (``build_ranks_store``): one cut of two ranks, step 9 (``RANKS_CUT``), written as
``Store.save(group=)`` writes it: each rank's uncompressed shards (rank 0 two, rank 1 one), then its
fragment ``cuts/<cut>/rank<r:05d>.json`` (``RankRecord`` format 2, ``record.to_bytes()``), then the
commit record ``MANIFEST.json`` (``Manifest`` format 5: the cut's fields and the table of the two
fragments' ``part_ref``) and LATEST naming it. The ranks' states are ``golden_rank_states()``.

History:
- ``v1/`` was written by this script running against commit 573d0f6 (format_version 1: a file's
  ``blake3`` is the plain blake3 of its bytes), extracted with ``git archive`` and put first on
  PYTHONPATH. It can no longer be regenerated: today's code writes format_version 4 only. Keep its
  bytes exactly as they are; it is what old stores on disk look like.
- ``v2/`` was written by this script up to commit 549261a (format_version 2: tensors as rows). It can
  no longer be regenerated either (today's code writes format_version 4); keep its bytes as they are.
- ``v4/`` is written by this script with the current code (format_version 4: tensors as one table,
  docs/format.md; its shards are v2's byte for byte, tests/store/test_golden.py checks it).
- ``v5/`` is written by this script with ``--ranks`` since issue 22 (format_version 5: a cut of two
  ranks as a commit record referencing each rank's fragment, RankRecord format 2, by size and blake3;
  tests/store/test_golden.py checks that today's code writes it byte for byte).

``golden_states()`` and ``golden_rank_states()`` must never change: the golden stores were written
from them and the tests compare against them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

CUTS = (
    # (cut id, step, codec name, tags, final)
    ("step-000000000007-0123abcd", 7, "none", ["golden"], False),
    ("step-000000000008-4567cdef", 8, "zstd", [], True),
)
#: The cut of several ranks of ``--ranks`` (v5/): (cut id, step, world size, tags, final).
RANKS_CUT = ("step-000000000009-89abcdef", 9, 2, ["golden", "ranks"], True)
CREATED_AT = "2024-01-02T03:04:05+00:00"
WRITER = {"host": "golden", "pid": 1, "ckptstore_version": "golden", "mode": "sync"}
MAX_SHARD_BYTES = 6000  # cut 7 gets two shards
ZSTD_LEVEL = 1
#: The zstandard package the checked-in v2 golden was compressed with: compressed bytes can differ
#: between zstd releases without any format change, so the byte-identity test compares the zstd
#: shard's compressed bytes only under this version (its decoded bytes always).
ZSTANDARD_VERSION = "0.25.0"


def golden_states() -> dict[int, dict[str, Any]]:
    """The state of each golden cut, by step. Only exactly representable values (no RNG)."""
    import numpy as np
    import torch

    step7 = {
        "model": {
            "w": torch.arange(1024, dtype=torch.float32).reshape(32, 32) / 7,  # 4096 bytes
            "b": (torch.arange(7, dtype=torch.float32) - 3).to(torch.bfloat16),  # 14 bytes: odd-sized
            "h": (torch.arange(15, dtype=torch.float32) / 4).to(torch.float16).reshape(3, 5),
            "ids": torch.arange(5, dtype=torch.int64) * 1000003,
            "mask": torch.tensor([True, False, True]),
            "z": torch.tensor([1 + 2j, -3.5 + 0.25j], dtype=torch.complex128),  # stored as U8
            "empty": torch.zeros(0, 3),
            "p": torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0])),
        },
        "opt": {
            "state": {0: {"exp_avg": torch.arange(2048, dtype=torch.int16) - 1024}},  # 4096 bytes
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "np": np.arange(10, dtype=np.int32).reshape(2, 5),
        "np_be": np.arange(3, dtype=">f8"),
        "np_scalar": np.float32(1.5),
        "step": 7,
        "lr": 0.001,
        "name": "golden",
        "flags": [True, None, float("inf")],
        "blob": b"\x00\x01\xff",
    }
    step8 = {
        "w": (torch.arange(4096, dtype=torch.int32) % 17).to(torch.float32),  # 16 KiB, compressible
        "b": torch.ones(5, dtype=torch.float16),
        "note": "zstd",
    }
    return {7: step7, 8: step8}


def golden_rank_states() -> dict[int, dict[str, Any]]:
    """The state of each rank of the golden cut of several ranks (``RANKS_CUT``), by rank: different
    values, shapes and keys per rank, several dtypes and plain values; only exactly representable
    values (no RNG). Must never change (v5/ was written from it)."""
    import numpy as np
    import torch

    states: dict[int, dict[str, Any]] = {}
    for r in range(RANKS_CUT[2]):
        n = 1536 if r == 0 else 256  # rank 0: 6144 bytes, a shard of its own; rank 1: one shard
        states[r] = {
            "model": {
                "w": (torch.arange(n, dtype=torch.float32) * (r + 1) / 8).reshape(-1, 32),
                "b": (torch.arange(5, dtype=torch.float32) - 2 * r).to(torch.bfloat16),  # 10 bytes: odd-sized
                "ids": torch.arange(4, dtype=torch.int64) * (1000003 + r),
            },
            "opt": {"state": {0: {"count": torch.tensor([9 + r], dtype=torch.int32)}},
                    "param_groups": [{"lr": 0.5 ** (r + 1), "params": [0]}]},
            "np": (np.arange(6, dtype=np.uint16) + 100 * r).reshape(2, 3),
            "rank": r,
            "name": f"golden rank {r}",
        }
    states[1]["h"] = torch.tensor([0.25, -1.5, 3.0], dtype=torch.float16)  # rank 1 only
    states[1]["flags"] = [True, None]
    return states


def _open_storage(root: str):  # type: ignore[no-untyped-def]
    try:
        from ckptstore.storage import open_storage
    except ImportError:  # the layout of commit 573d0f6, which wrote v1/
        from ckptstore.fs import open_storage  # type: ignore[no-redef]
    return open_storage(root)


def _write_cut_files(storage, cut: str, items: list, codec) -> tuple[list, list]:  # type: ignore[no-untyped-def]
    from ckptstore import shards

    if hasattr(shards, "write_shards"):
        return shards.write_shards(storage, cut, 0, items, codec=codec, max_shard_bytes=MAX_SHARD_BYTES)
    from ckptstore import layout  # commit 573d0f6: the loop Store.save ran then

    files, tensors = [], []
    for i, group in enumerate(shards.plan_shards(items, MAX_SHARD_BYTES)):
        rec, trecs = shards.write_shard(storage, cut, layout.shard_name(0, i, compressed=codec.name == "zstd"),
                                        0, group, codec)
        files.append(rec)
        tensors.extend(trecs)
    return files, tensors


def build_store(root: str) -> int:
    """Writes the golden store at ``root`` (must not exist) with the running ckptstore; returns the
    manifest format_version it wrote."""
    from ckptstore import hashing, layout
    from ckptstore.arrays import describe
    from ckptstore.latest import Pointer, StoreIdentity
    from ckptstore.manifest import Manifest, WriterIdentity
    from ckptstore.shards import Codec
    from ckptstore.tree import flatten

    os.makedirs(root)
    storage = _open_storage(root)
    for d in (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR):
        storage.make_dir(d)
    storage.write_durably(layout.STORE_FILE, StoreIdentity(created_at=CREATED_AT).to_bytes())
    states = golden_states()
    version = 0
    for cut, step, codec_name, tags, final in CUTS:
        tree, leaves = flatten(states[step])
        items = [describe(leaf) for leaf in leaves]
        codec = Codec("zstd", ZSTD_LEVEL) if codec_name == "zstd" else Codec()
        storage.make_dir(layout.cut_dir(cut))
        files, tensors = _write_cut_files(storage, cut, items, codec)
        manifest = Manifest(
            cut=cut, step=step, tags=tags, final=final, created_at=CREATED_AT, writer=WriterIdentity(**WRITER),
            world_size=1, metadata={"golden": True, "step": step}, files=files, tensors=tensors, tree=tree,
            pickled=False,
        )
        version = manifest.format_version
        data = manifest.to_bytes()
        storage.write_durably(layout.manifest_path(cut), data)
        storage.write_durably(layout.LATEST_FILE, Pointer(cut=cut, step=step, manifest_blake3=hashing.digest(data)).to_bytes())
    # git keeps no empty directories; a store reads the same without them.
    for d in (layout.MARKS_DIR, layout.BAD_DIR):
        os.rmdir(os.path.join(root, d))
    return version


def build_ranks_store(root: str) -> int:
    """Writes the golden store of one cut of several ranks (``RANKS_CUT``, ``golden_rank_states()``)
    at ``root`` (must not exist) with the running ckptstore, each rank's fragment then the commit
    record, as ``RankPart.publish`` and ``PendingCut.commit`` write them; returns the manifest
    format_version it wrote."""
    from ckptstore import hashing, layout
    from ckptstore.arrays import describe
    from ckptstore.latest import Pointer, StoreIdentity
    from ckptstore.manifest import FRAGMENTS_FORMAT_VERSION, Manifest, RankRecord, WriterIdentity
    from ckptstore.shards import Codec, write_shards
    from ckptstore.tree import flatten

    cut, step, world_size, tags, final = RANKS_CUT
    os.makedirs(root)
    storage = _open_storage(root)
    for d in (layout.CUTS_DIR, layout.MARKS_DIR, layout.BAD_DIR):
        storage.make_dir(d)
    storage.write_durably(layout.STORE_FILE, StoreIdentity(created_at=CREATED_AT).to_bytes())
    storage.make_dir(layout.cut_dir(cut))
    states = golden_rank_states()
    refs = []
    for rank in range(world_size):
        tree, leaves = flatten(states[rank])
        items = [describe(leaf) for leaf in leaves]
        files, tensors = write_shards(storage, cut, rank, items, codec=Codec(), max_shard_bytes=MAX_SHARD_BYTES)
        record = RankRecord(format_version=2, cut=cut, step=step, rank=rank, world_size=world_size,
                            created_at=CREATED_AT, writer=WriterIdentity(**WRITER), files=files, tensors=tensors,
                            tree=tree, pickled=False)
        data = record.to_bytes()
        storage.write_durably(layout.rank_record_path(cut, rank), data)
        refs.append(record.part_ref(data))
    manifest = Manifest(
        format_version=FRAGMENTS_FORMAT_VERSION, cut=cut, step=step, tags=list(tags), final=final,
        created_at=CREATED_AT, writer=WriterIdentity(**WRITER), world_size=world_size,
        metadata={"golden": True, "step": step}, parts=refs, pickled=False)
    data = manifest.to_bytes()
    storage.write_durably(layout.manifest_path(cut), data)
    storage.write_durably(layout.LATEST_FILE, Pointer(cut=cut, step=step, manifest_blake3=hashing.digest(data)).to_bytes())
    for d in (layout.MARKS_DIR, layout.BAD_DIR):
        os.rmdir(os.path.join(root, d))
    return manifest.format_version


def main(argv: list[str] | None = None) -> int:
    from ckptstore.manifest import FRAGMENTS_FORMAT_VERSION, Manifest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="replace an existing golden directory")
    parser.add_argument("--ranks", action="store_true",
                        help="write the golden cut of several ranks (v5/: commit record and fragments)")
    args = parser.parse_args(argv)
    if args.ranks:
        version, build = FRAGMENTS_FORMAT_VERSION, build_ranks_store
    else:
        version, build = Manifest.model_fields["format_version"].default, build_store
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"v{version}")
    if os.path.exists(out):
        if not args.force:
            print(f"{out} exists; pass --force to replace it", file=sys.stderr)
            return 1
        shutil.rmtree(out)
    wrote = build(out)
    assert wrote == version, (wrote, version)
    print(f"wrote {out} (format_version {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
