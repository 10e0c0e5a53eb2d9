"""Mirroring a store (issue 21, first part): a committed cut copied into another store byte for byte,
through that store's own protocol, every byte checked against the source's manifest as it streams.
Real files, the moto server for the S3 case, a real SIGKILLed process for the crash case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.spi as spi
from ckptstore import Store, StoreOptions, layout
from ckptstore.cli import main
from filekit import flip_byte, rewrite_manifest
from statekit import assert_bitwise

REPO = Path(__file__).resolve().parents[2]


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(40_000).astype(np.float32), "b": np.arange(700, dtype=np.int64) * step,
            "e": np.zeros(0, dtype=np.float16), "step": step, "name": f"cut {step}"}


def _two_ranks(store: Store, step: int) -> ckptstore.CutInfo:
    """A cut of two ranks written from this one process, as DCP's ranks write parts."""
    pending = store.begin_cut(step, world_size=2)
    for rank in range(2):
        tree, leaves = spi.flatten(_state(step * 10 + rank))
        part = spi.rank_part(store, pending.id, step, rank, 2)
        files, tensors = part.write([spi.describe(leaf) for leaf in leaves])
        part.publish(files, tensors, tree=tree, pickled=False)
    return pending.finish()


def _source(tmp_path: Path) -> str:
    """A local store of four cuts: zstd shards (step 1), several plain shards with an attached file
    (step 2), two ranks (step 3), one plain shard marked final after its commit (step 4)."""
    url = str(tmp_path / "local")
    with Store.open(url, create=True, options=StoreOptions(compression="zstd", max_shard_bytes=64 << 10)) as s:
        s.save(_state(1), step=1)
    (tmp_path / "notes.txt").write_text("attached to step 2\n")
    with Store.open(url, options=StoreOptions(max_shard_bytes=64 << 10)) as s:
        s.save(_state(2), step=2, files={"notes.txt": str(tmp_path / "notes.txt")})
        _two_ranks(s, 3)
    with Store.open(url) as s:
        s.save(_state(4), step=4)
        s.mark_final()  # after its commit (final/): the mirror's copy is final too
    return url


def _cuts(url: str, options: StoreOptions | None = None) -> list[tuple[str, int]]:
    with Store.open(url, readonly=True, options=options) as s:
        return [(c.id, c.step) for c in s.cuts()]


def _manifest_bytes(store: Store, cut: str) -> bytes:
    return store.storage.read_bytes(layout.manifest_path(cut))


def _assert_same_cuts(src_url: str, dst: Store, *, load_all: bool = True) -> None:
    """The mirror holds the source's cuts: the same ids, steps, LATEST, manifest bytes and bytes of
    every file of every rank, and it verifies; loads give the same states (every cut's with
    ``load_all``, else LATEST's)."""
    with Store.open(src_url, readonly=True) as src:
        assert [(c.id, c.step) for c in dst.cuts()] == [(c.id, c.step) for c in src.cuts()]
        assert dst.latest() == src.latest() and dst.latest().final
        for c in src.cuts():
            assert _manifest_bytes(dst, c.id) == _manifest_bytes(src, c.id)
            for f in src.manifest(c.id).files:
                rel = layout.cut_file(c.id, f.name)
                assert dst.storage.read_bytes(rel) == src.storage.read_bytes(rel), rel
            for rank in range(c.world_size) if load_all or c == src.latest() else ():
                r = rank if c.world_size > 1 else None
                assert_bitwise(dst.load(c.id, rank=r), src.load(c.id, rank=r), where=f"{c.id} rank {rank}")
    assert dst.verify().ok


def test_local_to_local_mirrors_every_cut_byte_for_byte_and_the_mirror_stands_alone(tmp_path, capsys) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    with Store.open(src_url, readonly=True) as src, Store.open(dst_url, create=True) as dst:
        report = spi.mirror_missing(src, dst)
        assert report.ok and [c.id for c in report.mirrored] == [c.id for c in src.cuts()]
        _assert_same_cuts(src_url, dst)
        # Idempotent: nothing is missing, and a second catch-up does nothing.
        assert spi.missing(src, dst) == []
        again = spi.mirror_missing(src, dst)
        assert again.mirrored == [] and again.failed == [] and again.removed == []
        assert spi.mirror_cut(src, dst, src.cuts()[0].id) == dst.cuts()[0]  # one already there: a no-op
    # The mirror alone: the CLI's ls and verify, and ckptstore.load, with no local tier in sight.
    capsys.readouterr()
    assert main(["ls", dst_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["id"], c["step"]) for c in listed["cuts"]] == _cuts(src_url) and listed["leftovers"] == []
    assert main(["verify", dst_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert_bitwise(ckptstore.load(dst_url), ckptstore.load(src_url))
    assert (ckptstore.load(dst_url, cut=3, rank=1)["w"] == _state(31)["w"]).all()


def test_local_to_s3_mirrors_every_cut_and_the_bucket_alone_loads_bitwise(tmp_path, s3_url) -> None:
    src_url = _source(tmp_path)
    url, opts = s3_url
    options = StoreOptions(storage_options=opts)
    with Store.open(src_url, readonly=True) as src, Store.open(url, create=True, options=options) as dst:
        report = spi.mirror_missing(src, dst)
        assert report.ok and len(report.mirrored) == 4
        _assert_same_cuts(src_url, dst, load_all=False)  # the same bytes of every file: the same states
        assert spi.missing(src, dst) == []
    with Store.open(url, readonly=True, options=options) as alone:  # a handle of the bucket alone
        assert spi.classify(alone).leftovers == [] and alone.latest().id == _cuts(src_url)[-1][0]
        assert_bitwise(alone.load(), ckptstore.load(src_url))


@pytest.mark.parametrize("which", ["zstd shard", "plain shard header", "tensor bytes"])
def test_a_corrupted_local_file_is_never_uploaded_and_the_mirror_keeps_its_older_cut(tmp_path, which) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    step = 1 if which == "zstd shard" else 2
    with Store.open(src_url, readonly=True) as src:
        bad = src.cuts()[step - 1].id
        name = src.manifest(bad).files[0].name
    flip_byte(os.path.join(src_url, layout.cut_file(bad, name)), 12 if which == "plain shard header" else -3)
    with Store.open(src_url, readonly=True) as src, Store.open(dst_url, create=True) as dst:
        if step == 2:
            spi.mirror_cut(src, dst, src.cuts()[0].id)
        before = dst.latest()
        with pytest.raises(ckptstore.DataError) as exc:
            spi.mirror_cut(src, dst, bad)
        assert exc.value.store == src.url and exc.value.cut == bad and name in str(exc.value)
        assert bad in spi.classify(src).bad  # recorded bad on the source
        assert dst.latest() == before and bad not in {c.id for c in dst.cuts()}
        assert not dst.storage.exists(layout.cut_file(bad, name))
        assert dst.gc().removed == [] and spi.classify(dst).leftovers == []
        assert not os.path.exists(os.path.join(dst_url, layout.cut_dir(bad)))
        # A catch-up skips the cut recorded bad and mirrors the rest.
        report = spi.mirror_missing(src, dst)
        assert report.ok and bad not in {c.id for c in dst.cuts()} and len(dst.cuts()) == 3


def test_a_catch_up_reports_a_corrupted_cut_and_goes_on_with_the_newer_ones(tmp_path) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    with Store.open(src_url, readonly=True) as src:
        bad = src.cuts()[1]
        flip_byte(os.path.join(src_url, layout.cut_file(bad.id, src.manifest(bad.id).files[-1].name)), -1)
        with Store.open(dst_url, create=True) as dst:
            report = spi.mirror_missing(src, dst)
            assert [e.cut for e in report.failed] == [bad.id] and not report.ok
            assert [c.step for c in report.mirrored] == [1, 3, 4] and dst.latest().step == 4
            assert report.to_json()["failed"][0]["path"] == layout.cut_file(bad.id, src.manifest(bad.id).files[-1].name)


def test_an_older_cut_mirrored_after_a_newer_one_leaves_latest_at_the_newer(tmp_path) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    with Store.open(src_url, readonly=True) as src, Store.open(dst_url, create=True) as dst:
        first, *_, newest = src.cuts()
        spi.mirror_cut(src, dst, newest.id)
        older = spi.mirror_cut(src, dst, first.id)
        assert older.id == first.id and dst.latest().id == newest.id
        assert [c.id for c in dst.cuts()] == [first.id, newest.id]
        cls = spi.classify(dst)
        assert cls.leftovers == [] and not dst.storage.exists(layout.mark_path(first.id))
        assert dst.verify().ok
        assert_bitwise(dst.load(first.id), src.load(first.id))
        assert spi.missing(src, dst) == [c.id for c in src.cuts()[1:-1]]
    with Store.open(dst_url) as dst:  # a writer open keeps it: committed by the invariant
        assert dst.recovered == [] and [c.id for c in dst.cuts()] == [first.id, newest.id]


def test_a_mirror_holding_another_cut_under_the_id_or_at_the_step_is_refused_naming_both(tmp_path) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    with Store.open(src_url, readonly=True) as src, Store.open(dst_url, create=True) as dst:
        first, second = src.cuts()[:2]
        spi.mirror_cut(src, dst, first.id)
        spi.mirror_cut(src, dst, second.id)
    rewrite_manifest(dst_url, first.id, lambda d: None)  # the same document, other bytes
    other = str(tmp_path / "other")
    with Store.open(other, create=True) as o:
        o.save({"x": np.ones(3)}, step=3)  # its own cut at the source's step 3
    with Store.open(src_url, readonly=True) as src:
        for url, cut in ((dst_url, first.id), (other, src.cuts()[2].id)):
            with Store.open(url) as dst:
                before = [(c.id, c.step) for c in dst.cuts()]
                with pytest.raises(spi.MirrorConflict) as exc:
                    spi.mirror_cut(src, dst, cut)
                assert exc.value.store == dst.url and src.url in str(exc.value)
                assert isinstance(exc.value, ckptstore.StepConflict)
                assert [(c.id, c.step) for c in dst.cuts()] == before and spi.classify(dst).leftovers == []


def test_a_conflict_below_the_mirrors_latest_is_found_by_the_step_in_the_cut_ids(tmp_path) -> None:
    """The mirror's other cut at the step sits below its LATEST: ``mirror_cut`` lists ``cuts/`` once
    (no classification) and finds it by the step its id carries."""
    src_url, other = _source(tmp_path), str(tmp_path / "other")
    with Store.open(other, create=True) as o:
        at_3 = o.save({"x": np.ones(3)}, step=3).id  # its own cut at the source's step 3
        o.save({"x": np.ones(3)}, step=5)
    with Store.open(src_url, readonly=True) as src, Store.open(other) as dst:
        first, _, third, fourth = src.cuts()
        with pytest.raises(spi.MirrorConflict) as exc:
            spi.mirror_cut(src, dst, third.id)
        assert (exc.value.store, exc.value.cut) == (dst.url, at_3) and src.url in str(exc.value)
        assert spi.mirror_cut(src, dst, fourth.id).id == fourth.id  # below LATEST (5), none other at its step
        assert spi.mirror_cut(src, dst, first.id).id == first.id
        assert [c.step for c in dst.cuts()] == [1, 3, 4, 5] and dst.latest().step == 5


def _put_mark(url: str, cut: str) -> None:
    from ckptstore.marks import Mark

    mark = Mark(cut=cut, step=layout.step_of_cut_id(cut), host="elsewhere", pid=1,
                started_at="2026-01-01T00:00:00+00:00", writer="store.save")
    Path(url, layout.mark_path(cut)).write_bytes(mark.to_bytes())


def test_a_source_cut_read_by_name_is_committed_exactly_when_a_classification_says_so(tmp_path) -> None:
    """The source's cut is read by name (its manifest, LATEST, its mark): a marked cut that LATEST does
    not name is in flight (``CutNotFound``, nothing uploaded); a stale mark beside LATEST's cut is not."""
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    with Store.open(src_url, readonly=True) as src:
        first, *_, newest = src.cuts()
    _put_mark(src_url, first.id)
    _put_mark(src_url, newest.id)  # a crash between LATEST and the mark's removal: still committed
    with Store.open(src_url, readonly=True) as src, Store.open(dst_url, create=True) as dst:
        assert first.id not in spi.classify(src).committed_ids() and newest.id in spi.classify(src).committed_ids()
        with pytest.raises(ckptstore.CutNotFound) as exc:
            spi.mirror_cut(src, dst, first.id)
        assert (exc.value.store, exc.value.cut) == (src.url, first.id)
        assert spi.mirror_cut(src, dst, newest.id) == dst.latest() and dst.latest().final
        assert [c.id for c in dst.cuts()] == [newest.id] and spi.classify(dst).leftovers == []
        with pytest.raises(ckptstore.CutNotFound):
            spi.mirror_cut(src, dst, first.id.replace(first.id[-8:], "0" * 8))  # no such cut


def test_the_cli_mirrors_what_is_missing_as_json_with_progress_on_stderr(tmp_path, capsys) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    assert main(["mirror", src_url, "--to", dst_url, "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [(c["id"], c["step"]) for c in doc["mirrored"]] == _cuts(src_url)
    assert doc["failed"] == [] and doc["latest"] == _cuts(src_url)[-1][0]
    assert "(1/4)" in err and "(4/4)" in err
    assert main(["mirror", src_url, "--to", dst_url]) == 0
    assert "mirrored 0 cut(s)" in capsys.readouterr().out
    with Store.open(src_url) as s:
        s.save(_state(5), step=5)
        bad = s.latest()
        flip_byte(os.path.join(src_url, layout.cut_file(bad.id, s.manifest().files[0].name)), -1)
    assert main(["mirror", src_url, "--to", dst_url]) == 1
    out, err = capsys.readouterr()
    assert bad.id in out and "hash" in out.lower()


#: The child: mirrors SRC into DST and SIGKILLs itself in the second cut, at a protocol phase of the
#: mirror or after the first bytes of its first file.
CHILD = textwrap.dedent("""
    import os, signal, sys
    import ckptstore.spi as spi
    from ckptstore import Store, StoreOptions
    src_url, dst_url, at = sys.argv[1:4]
    seen = []
    def die():
        sys.stdout.write("KILL\\n"); sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)
    def on_phase(phase, cut):
        seen.append(cut)
        if phase == at and len(set(seen)) == 2:
            die()
    def progress(n):
        if at == "mid-file" and len(set(seen)) == 2:
            die()
    with Store.open(src_url, readonly=True) as src, \\
            Store.open(dst_url, create=True, options=StoreOptions(on_phase=on_phase)) as dst:
        spi.mirror_missing(src, dst, progress=progress)
    sys.exit(3)
""")


@pytest.mark.parametrize("at", ["mid-file", "manifest-written"])
def test_a_mirror_killed_midway_holds_only_committed_cuts_and_a_rerun_completes(tmp_path, at) -> None:
    src_url, dst_url = _source(tmp_path), str(tmp_path / "mirror")
    child = subprocess.run([sys.executable, "-c", CHILD, src_url, dst_url, at], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert child.returncode == -signal.SIGKILL and "KILL" in child.stdout, child.stderr
    first = _cuts(src_url)[0]
    assert _cuts(dst_url) == [first]  # only the committed cut; the killed one is not
    with Store.open(dst_url, readonly=True) as look:
        assert spi.classify(look).leftovers != []  # what the kill left, still there
    with Store.open(dst_url) as dst:  # its recovery
        assert dst.recovered != [] and spi.classify(dst).leftovers == [] and dst.cuts()[0].id == first[0]
    rerun = subprocess.run([sys.executable, "-m", "ckptstore.cli", "mirror", src_url, "--to", dst_url, "--json"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert rerun.returncode == 0, rerun.stderr
    assert [c["id"] for c in json.loads(rerun.stdout)["mirrored"]] == [c for c, _ in _cuts(src_url)[1:]]
    with Store.open(dst_url, readonly=True) as dst:
        _assert_same_cuts(src_url, dst)


def test_a_corrupted_local_file_bound_for_s3_leaves_no_object_and_no_multipart_upload(tmp_path, s3_url, capsys) -> None:
    """A shard large enough for a multipart upload (16 MiB or more) whose last byte is damaged: its
    first part went up while it streamed, yet the upload is aborted, never completed. Through the CLI,
    the mirror's fsspec options from a file (``--to-storage-options @FILE``)."""
    src_url = str(tmp_path / "local")
    with Store.open(src_url, create=True) as s:
        good = s.save({"x": np.arange(10)}, step=1)
        bad = s.save({"big": np.arange(17 << 18, dtype=np.int32)}, step=2)  # 17 MiB in one shard
        name = s.manifest(bad.id).files[0].name
    flip_byte(os.path.join(src_url, layout.cut_file(bad.id, name)), -1)
    url, opts = s3_url
    (tmp_path / "s3.json").write_text(json.dumps(opts))
    assert main(["mirror", src_url, "--to", url, "--to-storage-options", f"@{tmp_path / 's3.json'}", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in doc["mirrored"]] == [good.id] and doc["latest"] == good.id
    assert [(f["cut"], f["path"], f["error"]) for f in doc["failed"]] == [(bad.id, layout.cut_file(bad.id, name),
                                                                           "HashMismatch")]
    with Store.open(url, options=StoreOptions(storage_options=opts)) as dst:
        assert dst.latest().id == good.id and not dst.storage.exists(layout.cut_file(bad.id, name))
        assert dst.storage.list_uploads("") == [] and spi.classify(dst).leftovers == [] and dst.recovered == []
    with Store.open(src_url, readonly=True) as src:
        assert bad.id in spi.classify(src).bad


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", "@/no/such/file.json"])
def test_the_cli_refuses_storage_options_that_are_no_json_object(tmp_path, value, capsys) -> None:
    src_url = _source_one(tmp_path)
    assert main(["mirror", src_url, "--to", str(tmp_path / "m"), "--to-storage-options", value]) == 2
    assert "--to-storage-options" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m")


def _source_one(tmp_path: Path) -> str:
    url = str(tmp_path / "one")
    with Store.open(url, create=True) as s:
        s.save({"x": np.arange(3)}, step=1)
    return url




def _small(step: int) -> dict[str, Any]:
    """A state of one shard whose shape is the same at every step: each cut costs the same requests."""
    return {"w": np.full(64, step, dtype=np.float32), "step": step}


def _into_bucket(fs: Any, local: str, url: str) -> None:
    """A local store's files put under ``url`` as they are (the same layout on both kinds of storage),
    its writer lock left out: in one batch, where saves or uploads on S3 cost a dozen requests a cut."""
    files = {}
    for root, _, names in os.walk(local):
        for name in set(names) - {layout.LOCK_FILE, layout.WRITER_FILE}:
            path = os.path.join(root, name)
            files[f"{url}/{os.path.relpath(path, local)}"] = Path(path).read_bytes()
    fs.pipe(files)


def _requests_with(n: int, tmp_path: Path, s3_url, fs: Any, proxies) -> dict[str, dict[str, int]]:
    """The requests (by operation) each store answers for two uploads into an S3 mirror holding ``n``
    cuts of an S3 source of ``n + 2``, each store behind a proxy of its own that logs them: the next
    cut (above the mirror's LATEST: the Checkpointer's case) and the first (below it: a catch-up's)."""
    base, opts = s3_url
    local, mirrored = str(tmp_path / f"src{n}"), str(tmp_path / f"mirror{n}")
    with Store.open(local, create=True) as s, Store.open(mirrored, create=True) as m:
        ids = [s.save(_small(step), step=step).id for step in range(1, n + 3)]
        for cut in ids[1:-1]:
            spi.mirror_cut(s, m, cut)
    src_url, dst_url = f"{base}-n{n}-src", f"{base}-n{n}-mirror"
    _into_bucket(fs, local, src_url)
    _into_bucket(fs, mirrored, dst_url)
    src_opts, dst_opts = (StoreOptions(storage_options=p.options(opts)) for p in proxies)
    counts: dict[str, dict[str, int]] = {}
    with Store.open(src_url, readonly=True, options=src_opts) as src, Store.open(dst_url, options=dst_opts) as dst:
        for which, cut in (("above latest", ids[-1]), ("below latest", ids[0])):
            assert all(p.settle() for p in proxies)
            before = [len(p.log) for p in proxies]
            spi.mirror_cut(src, dst, cut)
            assert all(p.settle() for p in proxies)
            for store, p, start in zip(("source", "mirror"), proxies, before):
                # The writer lease's renewal runs on its own clock: not a request of the upload.
                ops = [s.op for s in p.log[start:] if not s.key.endswith(layout.LEASE_FILE)]
                counts[f"{which}, {store}"] = {op: ops.count(op) for op in sorted(set(ops))}
        after = spi.classify(dst)
        assert [m.cut for m in after.committed] == ids and after.latest.cut == ids[-1] and after.leftovers == []
    return counts


def test_one_upload_costs_the_same_requests_whatever_the_number_of_cuts_on_either_store(
        tmp_path, s3_server, s3_url, s3_proxy) -> None:
    """Issue 21: ``mirror_cut`` runs once per committed cut, so it reads what it needs by name (the
    source's LATEST, manifest and marks of the cut; the mirror's manifest of it and LATEST) instead of
    classifying both stores, which cost O(cuts) listings and manifest reads per upload."""
    import s3fs
    from s3proxy import FaultProxy

    fs = s3fs.S3FileSystem(**s3_url[1])
    with FaultProxy(s3_server) as source_proxy:
        proxies = (source_proxy, s3_proxy)
        few, many = (_requests_with(n, tmp_path, s3_url, fs, proxies) for n in (3, 12))
    assert few == many, (few, many)
