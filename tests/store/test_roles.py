"""A handle's role is one value fixed at open (issue 20): a reader writes nothing, rank parts included; a
participant (``spi.open_participant``, DCP's ranks) writes rank parts of cuts a coordinator marks and
nothing else, holding no lock; ``readonly`` and ``storage`` are read-only."""

from __future__ import annotations

import numpy as np
import pytest

from ckptstore import KeepLast, Store, UsageError, spi
from ckptstore.arrays import describe
from ckptstore.intent import CutIntent
from ckptstore.store import Role
from ckptstore.tree import flatten


def _part_of(state: dict) -> tuple[dict, list]:
    tree, leaves = flatten(state)
    return tree, [describe(x) for x in leaves]


def test_a_reader_cannot_write_a_rank_part(tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as writer:
        pending = writer.begin_cut(1, world_size=2)
        with Store.open(url, readonly=True) as reader:
            assert reader.role is Role.READER and reader.readonly
            with pytest.raises(UsageError, match="opened readonly"):
                spi.rank_part(reader, pending.id, 1, 1, 2)
        pending.abandon()


def test_a_participant_writes_its_part_that_the_coordinator_commits_and_nothing_else(tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as writer:  # the coordinator holds the lock all along
        pending = writer.begin_cut(1, world_size=2)
        with spi.open_participant(url) as rank1:
            assert rank1.role is Role.PARTICIPANT and not rank1.readonly and rank1.ranks is None
            assert spi.lock_handoff(rank1) == ({"kind": "none"}, None)
            tree, items = _part_of({"w": np.arange(4.0), "r": 1})
            part = spi.rank_part(rank1, pending.id, 1, 1, 2)
            part.publish(*part.write(items), CutIntent(tree=tree))
            for what, call in [("begin_cut", lambda: rank1.begin_cut(2)), ("save", lambda: rank1.save({}, step=2)),
                               ("prune", lambda: rank1.prune(KeepLast(1))), ("gc", rank1.gc),
                               ("repair", rank1.repair), ("label", lambda: rank1.label("x", pending.id))]:
                with pytest.raises(UsageError, match="does not hold the writer lock"):
                    call()
        tree, items = _part_of({"w": np.zeros(2), "r": 0})
        mine = spi.rank_part(writer, pending.id, 1, 0, 2)
        mine.publish(*mine.write(items), CutIntent(tree=tree))
        pending.finish(CutIntent(world_size=2))
        assert writer.load(rank=1)["r"] == 1 and writer.load(rank=0)["r"] == 0


def test_the_role_and_the_storage_are_fixed_at_open(tmp_path):
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as writer:
        assert writer.role is Role.WRITER and writer.role == "writer" and not writer.readonly
        for name, value in [("readonly", True), ("role", Role.READER), ("storage", None)]:
            with pytest.raises(AttributeError):
                setattr(writer, name, value)
        assert writer.role is Role.WRITER
