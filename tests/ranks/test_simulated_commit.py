"""The commit of a cut of many simulated ranks (issue 22): a commit record that grows with ranks only.

Threads, each a rank with its own client of one real ``TCPStore`` and its own ``RankGroup``, save one cut
through the real save path (``ckptstore.saving``: prepare, begin, write, commit) on a real local store:
rank 0 a writer handle, the others participants. Each rank writes its part's fragment and tells rank 0
its size and digest, so rank 0 commits without reading any fragment; the cut's manifest (format 5) holds
one entry per rank; ``load(rank=r)`` reads the commit record and rank r's fragment alone; a fragment
whose bytes are not the ones the commit record names fails ``verify`` and is never loaded."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore import spi
from ckptstore.errors import HashMismatch
from ckptstore.saving import save
from ckptstore.storage import PosixStorage
from ckptstore.store import core_of

from .test_simulated_ranks import Counting, run_ranks, server  # noqa: F401 - the module's TCPStore fixture

K = 10  # arrays a rank


class FragmentReads(PosixStorage):
    """Counts every read of a rank's record (its fragment) by the verb, through every read verb."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: Counter[str] = Counter()

    def _count(self, rel: str) -> None:
        name = rel.rsplit("/", 1)[-1]
        if name.startswith("rank") and name.endswith(".json"):
            self.reads[name] += 1

    def read_bytes(self, rel: str) -> bytes:
        self._count(rel)
        return super().read_bytes(rel)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        self._count(rel)
        return super().read_range(rel, start, end)

    def open_reader(self, rel: str) -> Any:
        self._count(rel)
        return super().open_reader(rel)

    def map_file(self, rel: str) -> Any:
        self._count(rel)
        return super().map_file(rel)


def state_of(rank: int) -> dict[str, Any]:
    return {"w": [torch.full((3,), float(rank * 1000 + i)) for i in range(K)], "rank": rank}


def save_on_ranks(server: Any, root: Path, n: int, ns: str) -> tuple[FragmentReads, list[Any]]:
    storage = FragmentReads(str(root))
    writer = ckptstore.Store.open(storage, create=True)

    def body(r: int, g: Any, kv: Counting) -> Any:
        handle = writer if r == 0 else spi.open_participant(str(root))
        try:
            return save(core_of(handle).with_ranks(g), state_of(r), step=7, tags=["t"], final=False, metadata=None,
                        allow_pickle=False, files=None)
        finally:
            if r != 0:
                handle.close()

    try:
        out = run_ranks(server, n, body, ns)
    finally:
        core_of(writer).ranks = None
        writer.close()
    return storage, out


@pytest.mark.parametrize("n", [8, 64])
def test_the_commit_reads_no_fragment_and_records_one_entry_per_rank(server, tmp_path, n):
    root = tmp_path / "store"
    storage, out = save_on_ranks(server, root, n, f"commit-{n}")
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert len({o.id for o in out}) == 1 and out[0].world_size == n
    # Every rank wrote its own fragment; rank 0 (the writer's storage) read none of them to commit.
    assert storage.reads == Counter(), storage.reads
    cut = out[0].id
    data = (root / "cuts" / cut / "MANIFEST.json").read_bytes()
    doc = json.loads(data)
    assert doc["format_version"] == 5 and doc["world_size"] == n
    assert "files" not in doc and "tensors" not in doc and "tree" not in doc
    assert doc["parts"]["name"] == [f"rank{r:05d}.json" for r in range(n)]
    assert doc["parts"]["arrays"] == [K] * n and doc["parts"]["files"] == [1] * n
    # O(ranks) bytes: each rank's entry and the cut's fields (issue 22: at most 256 bytes a rank)
    fixed = len(json.dumps({k: v for k, v in doc.items() if k != "parts"}))
    assert (len(data) - fixed) / n <= 256, (len(data), fixed, n)
    assert out[0].files == n and out[0].tensors == n * K


def test_load_of_one_rank_reads_the_commit_record_and_its_fragment_alone(server, tmp_path):
    n = 8
    root = tmp_path / "store"
    _, out = save_on_ranks(server, root, n, "load")
    assert not [o for o in out if isinstance(o, BaseException)], out
    reader_storage = FragmentReads(str(root))
    with ckptstore.Store.open(reader_storage, readonly=True) as store:
        for r in (0, 5, n - 1):
            reader_storage.reads.clear()
            got = store.load(rank=r)
            assert got["rank"] == r and [t.tolist() for t in got["w"]] == [[float(r * 1000 + i)] * 3 for i in range(K)]
            assert reader_storage.reads == Counter({f"rank{r:05d}.json": 1}), reader_storage.reads
        whole = store.manifest()
        assert whole.world_size == n and len(whole.files) == n and len(whole.tensors) == n * K
        assert store.verify().ok


def test_a_fragment_that_is_not_the_commit_records_fails_verify_and_never_loads(server, tmp_path):
    n = 8
    root = tmp_path / "store"
    _, out = save_on_ranks(server, root, n, "tamper")
    assert not [o for o in out if isinstance(o, BaseException)], out
    cut = out[0].id
    frag = root / "cuts" / cut / "rank00003.json"
    # A fragment of the same size that still parses and describes the same files, but is not the bytes
    # the rank reported: the year of its creation time is another.
    data = frag.read_bytes()
    at = data.index(b'"created_at":"') + len(b'"created_at":"')
    year = int(data[at:at + 4])
    frag.write_bytes(data[:at] + str(year - 1).encode() + data[at + 4:])
    json.loads(frag.read_bytes())
    with ckptstore.Store.open(str(root), readonly=True) as store:
        report = store.verify()
        errors = [f for f in report.findings if f.severity == "error"]
        assert [(f.kind, f.path) for f in errors] == [("hash-mismatch", f"cuts/{cut}/rank00003.json")], errors
        with pytest.raises(HashMismatch) as exc:
            store.load(rank=3)
        assert exc.value.cut == cut and exc.value.path == f"cuts/{cut}/rank00003.json"
        assert store.load(rank=2)["rank"] == 2  # the other ranks' parts are whole
