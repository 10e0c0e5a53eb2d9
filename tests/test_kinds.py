"""Kinds are enums, never strings read out of messages or matched by prefix (issue 20).

Findings, leftovers, LATEST problems, protocol phases and writer modes are ``str`` enums: each member is
its old spelling for ``==``, hashing, JSON and formatting, so every output stays byte-identical, while
code compares members.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import filekit
from ckptstore import Finding, Store, layout
from ckptstore.errors import CorruptCut, HashMismatch
from ckptstore.kinds import StrKind
from ckptstore.protocol import PRUNE_PHASES, SAVE_PHASES, PrunePhase, SavePhase
from ckptstore.recovery import LatestProblem, LeftoverKind
from ckptstore.verify import FindingKind
from ckptstore.writer.options import WriterMode, WriterOptions

KINDS = [FindingKind, LeftoverKind, LatestProblem, SavePhase, PrunePhase, WriterMode]
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_member_is_its_spelling_for_eq_hash_json_and_format(kind: type[StrKind]) -> None:
    for m in kind:
        spelling = m.value
        assert m == spelling and spelling == m and hash(m) == hash(spelling)
        assert m in {spelling} and spelling in {m} and {spelling: 1}[m] == 1
        assert str(m) == f"{m}" == f"{m:>0}" == "%s" % m == spelling
        assert json.dumps({"k": m}) == json.dumps({"k": spelling})
        assert json.dumps([m], indent=2) == json.dumps([spelling], indent=2)
        assert kind(spelling) is m
    assert kind.spellings() == tuple(m.value for m in kind)


def test_every_leftover_and_latest_problem_has_its_finding_kind() -> None:
    for lo in LeftoverKind:
        assert FindingKind.of_leftover(lo) == f"leftover-{lo.value}" and not FindingKind.of_leftover(lo).about_latest
    for problem in LatestProblem:
        assert FindingKind.of_latest(problem) == f"latest-{problem.value}"
    assert {k for k in FindingKind if k.about_latest} == {FindingKind.of_latest(p) for p in LatestProblem}


def test_the_phase_tables_hold_every_phase_the_protocol_names() -> None:
    # "rank-written" (a rank's durable record in a cut of several ranks) was missing: the crash table's
    # completeness test (tests/store/test_crash_points.py) could not see it.
    assert "rank-written" in SAVE_PHASES and SAVE_PHASES == tuple(SavePhase)
    assert PRUNE_PHASES == tuple(PrunePhase)
    protocol = (Path(__file__).resolve().parent.parent / "ckptstore" / "protocol.py").read_text()
    fired = set(re.findall(r"self\.phase\((\w+)\.(\w+),", protocol))
    assert fired == {(type(p).__name__, p.name) for p in (*SAVE_PHASES, *PRUNE_PHASES)}


def test_the_cli_docs_list_every_finding_kind() -> None:
    text = (DOCS / "cli.md").read_text()
    para = text[text.index("Kinds (`ckptstore.verify.FindingKind`, a `str` enum spelled as here):"):]
    para = para[para.index(":") + 1 : para.index("\n\n")]
    assert set(re.findall(r"`([a-z][a-z-]+)`", para)) == set(FindingKind.spellings())


def test_a_finding_takes_a_spelling_as_its_member_and_refuses_an_unknown_kind() -> None:
    assert Finding("error", "io-error", "m").kind is FindingKind.IO_ERROR
    with pytest.raises(ValueError):
        Finding("error", "no-such-kind", "m")


def test_verify_reports_typed_kinds_spelled_as_before(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as store:
        store.save({"a": np.arange(8)}, step=1)
        Path(url, layout.tmp_name(layout.LATEST_FILE)).write_bytes(b"{}")  # a crash mid-replace leaves it
        cls = store.classify()
        assert [(lo.kind, type(lo.kind)) for lo in cls.leftovers] == [("temp-file", LeftoverKind)]
        report = store.verify()
    assert [f.kind for f in report.findings] == [FindingKind.LEFTOVER_TEMP_FILE]
    assert '"kind": "leftover-temp-file"' in json.dumps(report.to_json())


def test_damage_of_a_file_whose_tensor_is_named_blake3_is_corrupt_not_a_hash_mismatch(tmp_path: Path) -> None:
    """verify used to call any CorruptCut whose message said "blake3" a hash mismatch: a damaged header
    of a shard holding a tensor named so was reported as changed bytes. The kind is now the error's
    type (``HashMismatch``)."""
    url = str(tmp_path / "store")
    with Store.open(url, create=True) as store:
        info = store.save({"blake3": np.arange(16, dtype=np.float32)}, step=1)

    def reshape(doc: dict) -> None:  # the same bytes, another shape: the header no longer agrees
        (t,) = doc["tensors"]
        t["shape"] = [4, 4]

    filekit.rewrite_manifest(url, info.id, reshape)
    with Store.open(url, readonly=True) as store:
        report = store.verify()
    assert [(f.kind, f.cut) for f in report.errors] == [(FindingKind.CORRUPT_FILE, info.id)], report.errors
    assert "'blake3'" in report.errors[0].message
    assert issubclass(HashMismatch, CorruptCut)


def test_writer_mode_is_a_member_and_the_manifest_spells_it_as_before(tmp_path: Path) -> None:
    from ckptstore.writer import Checkpointer

    assert WriterOptions(mode="thread").mode is WriterMode.THREAD
    with pytest.raises(ValueError, match="mode must be 'process', 'thread' or 'inline'"):
        WriterOptions(mode="fork")  # type: ignore[arg-type]
    url = str(tmp_path / "store")
    with Checkpointer(url, every=1, mode="thread") as ck:
        info = ck.cut(1, {"a": np.arange(8)}).wait(30)
    doc = json.loads(Path(url, "cuts", info.id, "MANIFEST.json").read_bytes())
    assert doc["writer"]["mode"] == "thread" and type(doc["writer"]["mode"]) is str
    assert not os.listdir(Path(url, "marks"))


def test_changed_bytes_raise_hash_mismatch_a_corrupt_cut(tmp_path: Path) -> None:
    """A load that finds a digest differing raises ``HashMismatch`` (still a ``CorruptCut``, so
    ``except CorruptCut`` and the CLI's exit codes hold), the type audits and callers branch on."""
    import ckptstore

    url = str(tmp_path / "store")
    with Store.open(url, create=True) as store:
        info = store.save({"a": np.arange(4096, dtype=np.float64)}, step=1)
    (shard,) = [p for p in Path(url, "cuts", info.id).iterdir() if layout.is_shard_name(p.name)]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the array's data
    shard.write_bytes(bytes(data))
    with pytest.raises(HashMismatch) as err:
        ckptstore.load(url)
    assert isinstance(err.value, CorruptCut) and err.value.cut == info.id and "blake3 mismatch" in err.value.message
