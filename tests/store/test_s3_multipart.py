"""Multipart uploads that never leak, and integrity on the wire (issue 24), on the moto server through
the fault-injecting proxy (tests/s3proxy.py).

A shard of 16 MiB or more goes up as a multipart upload ckptstore runs itself
(ckptstore/storage/multipart.py): the states here hold one 20 MiB array (a shard of two parts) and a
small one (a shard of one plain PUT). Every test ends with :func:`_check`: seen through a client that
bypasses the proxy, every committed cut loads bitwise and verifies, nothing is left over, nothing is
recorded bad, and no multipart upload is left in the bucket.

What each test caught before, run against commit 50c3014 (before ckptstore ran multipart uploads
itself; there s3fs sent a 20 MiB shard as one PUT, its block being 50 MiB, so the part rules did not
fire): a bit flipped in a shard or the manifest was committed and the cut failed verify; one in LATEST
was committed and every read of LATEST failed; after a SIGKILL mid-upload gc listed no upload. The lost
CreateMultipartUpload answer's leak is the one issue 24 confirmed through s3fs's own multipart upload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest
from s3proxy import Rule, flip_bit
from test_s3_faults import check_store

import ckptstore
from ckptstore import StoreOptions, layout
from ckptstore.cli import main
from ckptstore.storage.multipart import PART_BYTES

_BIG = 5 << 20  # float32 elements: 20 MiB, so shard 0 is a multipart upload of two parts
_SHARD0 = "*/cuts/*/rank00000-00000.safetensors"  # the big array's shard
_SHARD1 = "*/cuts/*/rank00000-00001.safetensors"  # the small array's: one plain PUT


def _state(i: int) -> dict:
    return {"model": {"w": np.arange(_BIG, dtype=np.float32) + i, "b": np.arange(1000, dtype=np.int64) * i},
            "step": i}


def _options(opts: dict, **kw) -> StoreOptions:
    # 16 MiB shards: the 20 MiB array alone in shard 0 (an array is never split), the small one in shard 1
    return StoreOptions(storage_options=opts, max_shard_bytes=PART_BYTES, **kw)


def _check(url: str, opts: dict, steps: list[int]) -> None:
    """test_s3_faults.py's check for these states: every committed cut loads bitwise and verifies, LATEST
    names the last, nothing left over or recorded bad; and no multipart upload is left."""
    def same(out: dict, step: int) -> None:
        want = _state(step)["model"]
        assert out["model"]["w"].tobytes() == want["w"].tobytes()
        assert out["model"]["b"].tobytes() == want["b"].tobytes()

    check_store(url, opts, steps, same)


def _ids(store: ckptstore.Store) -> list[str]:
    """The ids of the uploads in progress under the store (moto's upload ages are made up)."""
    return [u.upload_id for u in store.storage.list_uploads()]


def _ops(proxy, op: str) -> list[tuple[int | None, str | None, int]]:
    return [(s.part, s.action, s.status) for s in proxy.requests(op=op)]


def test_a_503_on_a_part_and_a_reset_mid_part_are_retried_alone_and_the_save_commits(s3_url, s3_proxy):
    url, opts = s3_url
    rules = [s3_proxy.add(Rule("slowdown", op="upload_part", part=2, attempts={1})),
             s3_proxy.add(Rule("reset_request", op="upload_part", part=1, attempts={1}, after_bytes=1 << 20))]
    with ckptstore.Store.open(url, create=True, options=_options(s3_proxy.options(opts))) as store:
        assert store.save(_state(1), step=1).step == 1
        assert store.storage.stats.by_action.get("uploading part", 0) >= 1  # aiohttp resends a reset one itself
    assert [r.fired for r in rules] == [1, 1]
    parts = _ops(s3_proxy, "upload_part")  # part 1 sent again (aiohttp may resend once itself), then part 2
    assert parts[0] == (1, "reset_request", 0) and parts[-2:] == [(2, "slowdown", 0), (2, None, 200)]
    assert _ops(s3_proxy, "create_multipart") == [(None, None, 200)]  # the parts retried alone, one upload
    _check(url, opts, [1])


def test_a_lost_create_multipart_answer_leaves_no_upload(s3_url, s3_proxy):
    """The create lands, its answer is lost, the retry makes a second upload: the first one's id is
    known to nobody. Before, it stayed in the bucket (and gc never saw it); now the save sweeps it."""
    url, opts = s3_url
    rule = s3_proxy.add(Rule("lost", op="create_multipart", attempts={1}))
    with ckptstore.Store.open(url, create=True, options=_options(s3_proxy.options(opts))) as store:
        store.save(_state(1), step=1)
    assert rule.fired == 1
    assert _ops(s3_proxy, "create_multipart") == [(None, "lost", 200), (None, None, 200)]  # moto made two
    assert _ops(s3_proxy, "abort_multipart") == [(None, None, 204)]
    _check(url, opts, [1])


def test_a_lost_complete_multipart_answer_is_recognised_and_the_save_commits(s3_url, s3_proxy):
    url, opts = s3_url
    rule = s3_proxy.add(Rule("lost", op="complete_multipart", times=1))  # the first save's
    with ckptstore.Store.open(url, create=True, options=_options(s3_proxy.options(opts))) as store:
        store.save(_state(1), step=1)
        store.save(_state(2), step=2)
    assert rule.fired == 1 and _ops(s3_proxy, "complete_multipart")[:2] == [(None, "lost", 200), (None, None, 200)]
    _check(url, opts, [1, 2])


# name -> the rule's matchers, and the saves (LATEST's PUTs: 1 the create, 2 its repair, 3 the second
# save's replace, 4 its repair; so {1, 3} damages a conditional create and a conditional replace)
_CORRUPT = {
    "part": (dict(op="upload_part", part=2, attempts={1}), [1]),
    "single-put-shard": (dict(op="put", key=_SHARD1, attempts={1}), [1]),
    "manifest": (dict(op="put", key="*/MANIFEST.json", attempts={1}), [1]),
    "latest": (dict(op="put", key="*/LATEST", attempts={1, 3}), [1, 2]),
}


@pytest.mark.parametrize("what", list(_CORRUPT))
def test_a_body_damaged_on_the_wire_is_sent_again_and_never_committed(s3_url, s3_proxy, what):
    """One bit flipped in flight: moto stores the damaged body (it checks no Content-MD5) and answers
    its MD5 as the ETag. Before, the save reported committed and the cut then failed verify (a part,
    a shard, the manifest) or LATEST did not parse; now the ETag is compared and the body sent again."""
    url, opts = s3_url
    matchers, steps = _CORRUPT[what]
    rule = s3_proxy.add(Rule("corrupt", **matchers))
    with ckptstore.Store.open(url, create=True, options=_options(s3_proxy.options(opts))) as store:
        for step in steps:
            assert store.save(_state(step), step=step).step == step
        assert rule.fired == len(matchers["attempts"]) and store.storage.stats.retries >= rule.fired
    damaged = [s for s in s3_proxy.log if s.action == "corrupt"]
    assert len(damaged) == rule.fired and all(s.status == 200 for s in damaged)  # stored, then replaced
    _check(url, opts, steps)


def test_the_corrupt_rule_flips_a_payload_bit_and_never_the_aws_chunked_framing():
    assert flip_bit(b"abcd") == b"abbd" and flip_bit(b"abcd", 0) == b"`bcd" and flip_bit(b"") == b""
    framed = (b"3;chunk-signature=00\r\nabc\r\n2;chunk-signature=11\r\nde\r\n0;chunk-signature=22\r\n"
              b"x-amz-checksum-crc32:AAAAAA==\r\n\r\n")
    assert flip_bit(framed, 3, aws_chunked=True) == framed.replace(b"de", b"ee")  # payload byte 3: "d"
    assert flip_bit(framed, aws_chunked=True) == framed.replace(b"abc", b"abb")  # the middle of 5: "c"
    unsigned = b"4\r\nwxyz\r\n0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n"
    assert flip_bit(unsigned, 99, aws_chunked=True) == unsigned.replace(b"wxyz", b"wxy{")  # clamped: last


_CHILD = """
import json, sys
import numpy as np
import ckptstore
from ckptstore import StoreOptions
from ckptstore.storage.multipart import PART_BYTES
cfg = json.loads(sys.stdin.readline())
options = StoreOptions(storage_options=cfg["opts"], max_shard_bytes=PART_BYTES, lease_ttl_s=cfg["ttl"])
with ckptstore.Store.open(cfg["url"], options=options) as store:
    store.save({"model": {"w": np.arange(5 << 20, dtype=np.float32) + 2, "b": np.arange(1000) * 2}, "step": 2},
               step=2)
"""


def _open_once_free(url: str, options: StoreOptions, deadline_s: float, **kw) -> ckptstore.Store:
    """Opens as the writer once the killed writer's lease ran out (bounded by ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return ckptstore.Store.open(url, options=options, **kw)
        except ckptstore.StoreLocked:
            assert time.monotonic() < deadline, "the killed writer's lease never expired"
            time.sleep(0.1)  # polling a lease with a bound, not timing anything


def test_a_writer_killed_mid_multipart_leaves_an_upload_gc_lists_and_aborts(s3_url, s3_proxy, tmp_path, capsys,
                                                                             monkeypatch):
    """A real writer process SIGKILLed while part 2 is in flight (stalled): before, ``gc(dry_run=True)``
    did not list the upload and ``gc()`` did not abort it; now both do, as does ``ckptstore gc --dry-run``."""
    url, opts = s3_url
    ttl = 3.0
    with ckptstore.Store.open(url, create=True, options=_options(opts)) as store:
        store.save(_state(1), step=1)
    stall = s3_proxy.add(Rule("stall", op="upload_part", part=2, stall_s=60.0))
    log = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=log, stderr=log, text=True)
    try:
        proc.stdin.write(json.dumps({"url": url, "opts": s3_proxy.options(opts), "ttl": ttl}) + "\n")
        proc.stdin.close()
        assert s3_proxy.wait_for(lambda: stall.fired >= 1, timeout=60), (tmp_path / "child.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    with _open_once_free(url, _options(opts), deadline_s=20 * ttl, recover=False) as store:
        [upload] = store.storage.list_uploads()
        assert upload.rel.endswith("rank00000-00000.safetensors")
        report = store.gc(dry_run=True)
        cut = upload.rel.split("/")[1]
        # the mark of a dead writer (no object under the cut yet: an upload in progress makes none)
        assert [(lo.kind, lo.cut) for lo in report.removed] == [("orphan-mark", cut), ("upload", cut)]
        assert report.removed[0].owner_alive is False and report.removed[1].upload_id == upload.upload_id
        assert _ids(store) == [upload.upload_id]  # a dry run aborts nothing
    # The CLI's dry run lists it too, table and JSON (the command takes its S3 settings from fsspec's config).
    monkeypatch.setitem(fsspec.config.conf, "s3", opts)
    assert main(["gc", url, "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"cut": cut, "kind": "upload", "paths": [upload.rel], "owner": None, "owner_alive": None,
            "upload_id": upload.upload_id} in doc["removed"]
    assert main(["gc", url, "--dry-run"]) == 0
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("upload ")]
    assert row == ["upload", cut, upload.rel, "(upload", f"{upload.upload_id})"]
    with ckptstore.Store.open(url, options=_options(opts), recover=False) as store:
        report = store.gc()
        assert ("upload", cut) in [(lo.kind, lo.cut) for lo in report.removed]
        assert store.storage.list_uploads() == []
    _check(url, opts, [1])


def test_gc_keeps_the_upload_of_a_cut_in_flight_and_recovery_aborts_orphans_but_not_foreign_ones(s3_url):
    """An upload running on this handle (its cut in ``in_flight``) is kept by gc; at the next writer
    open, recovery aborts uploads under a committed cut (a lost create's twin) or under no cut, and
    leaves one outside ``cuts/`` alone as foreign (ckptstore writes uploads nowhere else)."""
    url, opts = s3_url
    with ckptstore.Store.open(url, create=True, options=_options(opts)) as store:
        first = store.save(_state(1), step=1).id
        pending = store.begin_cut(2)
        sink = store.storage.open_sink(layout.cut_file(pending.id, "rank00000-00000.safetensors"))
        sink.write(b"\0" * (PART_BYTES + 1))  # the create and part 1 are sent now: an upload in progress
        [running] = store.storage.list_uploads()
        for dry_run in (True, False):
            report = store.gc(dry_run=dry_run)
            assert [(lo.kind, lo.cut, lo.upload_id) for lo in report.kept] == [
                ("orphan-mark", pending.id, None), ("upload", pending.id, running.upload_id)]
            assert report.removed == []
        assert _ids(store) == [running.upload_id]
        sink.abort()
        pending.abandon()
    fs = fsspec.filesystem("s3", **opts)
    root = url.removeprefix("s3://")
    keys = {"twin": f"{root}/{layout.cut_file(first, 'rank00000-00000.safetensors')}",
            "no-cut": f"{root}/{layout.cut_file('step-000000000009-0badc0de', 'rank00000-00000.safetensors')}",
            "foreign": f"{root}/notes/big.bin"}
    ids = {name: fs.call_s3("create_multipart_upload", Bucket="ckpt", Key=key.partition("/")[2])["UploadId"]
           for name, key in keys.items()}
    with ckptstore.Store.open(url, options=_options(opts)) as store:
        assert sorted((lo.kind, lo.upload_id) for lo in store.recovered) == sorted(
            [("upload", ids["twin"]), ("upload", ids["no-cut"])])
        [left] = store.storage.list_uploads()
        assert (left.rel, left.upload_id) == ("notes/big.bin", ids["foreign"])
        assert store.gc().foreign == [f"notes/big.bin (multipart upload {ids['foreign']})"]
        store.storage.abort_upload(left)  # the test's own, cleaned up by the test
    _check(url, opts, [1])
