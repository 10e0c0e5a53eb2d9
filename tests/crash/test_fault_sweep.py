"""Fault sweep, beside the power-loss sweep: no single storage fault demotes or loses a committed cut.

Every storage call of ``save``, ``prune``, ``gc``, the writer ``Store.open`` (recovery), ``repair`` and
``load(fallback=True)`` (writer and readonly handle) fails once with EIO, one call at a time
(:mod:`faultfs`); then, without faults, the store is reopened as a writer (recovery runs) and every cut
that was reported committed and not removed by a prune policy must load with bit-identical values and
verify, LATEST must not have moved below the newest of them, and a whole-store ``verify`` must find no
error other than about cuts a policy removed. Whatever the operation raised under the fault must be a
ckptstore error, never a raw exception; a transient I/O error must never record an intact cut bad.

The cases are made at collection: a counting run of each operation (on a copy of its template store)
learns how many storage calls it makes and which; then there is one case per call (and, for calls whose
effect is followed by a durability step, a second one where the effect lands and only the trailing
fsync fails: ``-after-effect``), plus a ``-baseline`` case without any fault. Each case copies a
prepared template store rather than saving again.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import KeepLast, Store, hashing, layout
from ckptstore.errors import CkptStoreError, LatestError, StoreLocked
from ckptstore.latest import Pointer
from ckptstore.marks import Mark
from ckptstore.protocol import now_iso
from ckptstore.store import open_for_repair

from .faultfs import Call, FaultPlan, FaultyStorage, PosixStorage, direct_io, normalize
from .invariant import _equal

# --------------------------------------------------------------------------------------------------
# states and template stores


#: Steps whose state has many small arrays (issue 23: the bulk paths of the shard writer, the manifest
#: table and the loader, under the same faults as every other save).
MANY_STEPS = range(11, 16)
MANY = 600


def many_state(step: int) -> dict[str, Any]:
    """MANY small arrays of mixed dtypes and sizes (odd, zero-size, 0-d, numpy): 150 KB, three shards of 64 KiB."""
    g = torch.Generator().manual_seed(step)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
    layers = {f"l{i:03d}": torch.randn(i % 7 + (i % 3) * 64, generator=g).to(dtypes[i % 4]) for i in range(MANY)}
    return {"layers": layers, "empty": torch.zeros(0, 3), "scalar": torch.tensor(float(step)),
            "np": np.arange(step, dtype=np.int16), "step": step}


def state(step: int) -> dict[str, Any]:
    """A tiny state: two torch tensors (one bfloat16), a numpy array and python scalars (MANY_STEPS:
    :func:`many_state`)."""
    if step in MANY_STEPS:
        return many_state(step)
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 8, generator=g), "b": torch.full((3,), float(step), dtype=torch.bfloat16)},
        "opt": np.arange(6, dtype=np.int64) + step,
        "step": step,
        "tag": f"s{step}",
    }


@dataclass
class Template:
    root: str
    cuts: dict[int, str]  # step -> id of every committed cut


_BASE: str | None = None
_TEMPLATES: dict[str, Template] = {}


def _tmp_root() -> str | None:
    """Where the stores live: $CKPT_FAULT_SWEEP_TMP, else /dev/shm where writable (the sweep is about
    what the store does with a failed call, not about the disk; on tmpfs the hundreds of fsyncs cost
    nothing, which keeps the file well inside its time budget), else the default temp dir."""
    want = os.environ.get("CKPT_FAULT_SWEEP_TMP")
    if want:
        return want
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None


def _base_dir() -> str:
    global _BASE
    if _BASE is None:
        _BASE = tempfile.mkdtemp(prefix="ckpt-fault-sweep-", dir=_tmp_root())
        atexit.register(shutil.rmtree, _BASE, True)
    return _BASE


@pytest.fixture
def case_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="case-", dir=_base_dir())
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _save_cuts(root: str, steps: list[int], *, pinned: tuple[int, ...] = ()) -> dict[int, str]:
    with Store.open(root, create=True) as store:
        return {s: store.save(state(s), step=s, tags=["keep"] if s in pinned else []).id for s in steps}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait(30)
    return p.pid


def _put_mark(root: str, cut: str, pid: int) -> None:
    mark = Mark(cut=cut, step=layout.step_of_cut_id(cut), host=socket.gethostname(), pid=pid,
                started_at=now_iso(), writer="store.save")
    with open(os.path.join(root, layout.mark_path(cut)), "wb") as f:
        f.write(mark.to_bytes())


def _point_latest_at(root: str, cut: str) -> None:
    with open(os.path.join(root, layout.manifest_path(cut)), "rb") as f:
        digest = hashing.digest(f.read())
    ptr = Pointer(cut=cut, step=layout.step_of_cut_id(cut), manifest_blake3=digest)
    with open(os.path.join(root, layout.LATEST_FILE), "wb") as f:
        f.write(ptr.to_bytes())


def attach_src() -> str:
    """Files attached to cuts in the sweep (a small directory of two files), made once."""
    src = os.path.join(_base_dir(), "attach-src")
    if not os.path.isdir(src):
        os.makedirs(os.path.join(src, "journal"))
        with open(os.path.join(src, "config.yaml"), "w") as f:
            f.write("lr: 0.1\n")
        with open(os.path.join(src, "journal", "000.log"), "wb") as f:
            f.write(bytes(range(256)) * 40)
    return src


def _build_with_files(root: str) -> Template:
    """Cuts 1..2, each with the files of :func:`attach_src` attached."""
    with Store.open(root, create=True) as store:
        return Template(root, {s: store.save(state(s), step=s, files=[attach_src()]).id for s in (1, 2)})


def _build_plain(steps: list[int], pinned: tuple[int, ...] = ()) -> Callable[[str], Template]:
    return lambda root: Template(root, _save_cuts(root, steps, pinned=pinned))


def _build_no_latest(root: str) -> Template:
    """Committed cuts 1..3 whose LATEST was deleted (repair's case)."""
    cuts = _save_cuts(root, [1, 2, 3])
    os.unlink(os.path.join(root, layout.LATEST_FILE))
    return Template(root, cuts)


def _build_leftovers(root: str) -> Template:
    """Committed cuts 1..3 (LATEST names 3) and what crashes leave, built as
    tests/store/test_recovery_fixtures.py builds them: a complete marked cut of a dead writer that LATEST
    does not name (4), a marked cut of a dead writer without manifest (5), a stale mark beside LATEST's
    cut (3), a cut directory without manifest or mark (abandoned by a prune), a mark without a cut
    directory, and temp files of interrupted durable writes."""
    cuts = _save_cuts(root, [1, 2, 3, 4, 5])
    dead = _dead_pid()
    _point_latest_at(root, cuts[3])
    _put_mark(root, cuts[4], dead)
    os.unlink(os.path.join(root, layout.manifest_path(cuts[5])))
    _put_mark(root, cuts[5], dead)
    _put_mark(root, cuts[3], dead)
    abandoned = os.path.join(root, layout.cut_dir("step-000000000006-00000000"))
    os.mkdir(abandoned)
    with open(os.path.join(abandoned, layout.shard_name(0, 0, compressed=False)), "wb") as f:
        f.write(b"partial shard")
    _put_mark(root, "step-000000000007-0badc0de", dead)
    for rel in (".tmp-0123456789ab-LATEST", f"cuts/{cuts[2]}/.tmp-0123456789ab-{layout.MANIFEST_FILE}",
                f"marks/.tmp-0123456789ab-{cuts[4]}.json"):
        with open(os.path.join(root, *rel.split("/")), "wb") as f:
            f.write(b'{"kind": "ckptstore.lat')  # torn
    committed = {s: cuts[s] for s in (1, 2, 3)}
    with Store.open(root, readonly=True) as ro:  # the template really is what it claims
        cls = ro.classify()
        assert cls.committed_ids() == set(committed.values()) and cls.latest_problem is None
        kinds = sorted(lo.kind for lo in cls.leftovers)
        assert kinds == ["abandoned", "in-progress", "in-progress", "orphan-mark", "stale-mark",
                         "temp-file", "temp-file", "temp-file"], kinds
    return Template(root, committed)


BUILDERS: dict[str, Callable[[str], Template]] = {
    "cuts-1-2": _build_plain([1, 2]),
    "cuts-1-5": _build_plain([1, 2, 3, 4, 5], pinned=(2,)),
    "cuts-1-3": _build_plain([1, 2, 3]),
    "no-latest": _build_no_latest,
    "leftovers": _build_leftovers,
    "files-1-2": _build_with_files,
    "many-11-12": _build_plain([11, 12]),
}


def template(name: str) -> Template:
    if name not in _TEMPLATES:
        _TEMPLATES[name] = BUILDERS[name](os.path.join(_base_dir(), name))
    return _TEMPLATES[name]


# --------------------------------------------------------------------------------------------------
# the operations, each run with one FaultPlan


@dataclass
class Outcome:
    result: Any = None
    error: BaseException | None = None
    expect: dict[int, str] = field(default_factory=dict)  # step -> cut id that must load and verify after
    removed: set[str] = field(default_factory=set)  # cut ids a retention policy removed on purpose
    problems: list[str] = field(default_factory=list)
    repair_allowed: bool = False  # the clean reopen may run repair first (LATEST was missing to begin with)
    no_bad: bool = False  # nothing may be recorded in bad/ (every cut is intact)


def _faulty(root: str, plan: FaultPlan) -> FaultyStorage:
    return FaultyStorage(PosixStorage(root), plan)


def _under_fault(storage: FaultyStorage, out: Outcome, fn: Callable[[], Any]) -> None:
    """Runs ``fn`` with the plan recording (and so the one fault armed), direct I/O under the store root
    included; keeps what it returned or raised."""
    plan = storage.plan
    with direct_io(storage):
        plan.recording = True
        try:
            out.result = fn()
        except Exception as exc:  # noqa: BLE001 - judged by the test
            out.error = exc
        finally:
            plan.recording = False


def _save_then_two_more(root: str, tpl: Template, plan: FaultPlan, step: int, *,
                        options: ckptstore.StoreOptions | None = None, **kw: Any) -> Outcome:
    """save(step) under the fault; then, without faults, step + 1 and step + 2 on the same handle."""
    out = Outcome(expect=dict(tpl.cuts))
    storage = _faulty(root, plan)
    store = Store.open(storage, options=options)
    try:
        _under_fault(storage, out, lambda: store.save(state(step), step=step, **kw))
        if out.error is None:
            out.expect[step] = out.result.id  # reported committed
        for later in (step + 1, step + 2):
            try:
                out.expect[later] = store.save(state(later), step=later).id
            except Exception as exc:  # noqa: BLE001
                out.problems.append(f"save(step={later}) without faults after the fault failed: {normalize(repr(exc))}")
    finally:
        store.close()
    return out


def op_save(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """save(step=3) under the fault; then, without faults, save(4) and save(5) on the same handle."""
    return _save_then_two_more(root, tpl, plan, 3, tags=["keep"], final=True)


def op_prune(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """prune(KeepLast(2)) of cuts 1..5 (2 tagged "keep"): keeps 4, 5 (policy), 2 (tag), 5 (LATEST)."""
    out = Outcome(expect={s: tpl.cuts[s] for s in (2, 4, 5)}, removed={tpl.cuts[1], tpl.cuts[3]})
    storage = _faulty(root, plan)
    store = Store.open(storage)
    try:
        _under_fault(storage, out, lambda: store.prune(KeepLast(2)))
    finally:
        store.close()
    return out


def op_gc(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """gc() on a writer handle opened without recovery (so the leftovers are still there for gc)."""
    out = Outcome(expect=dict(tpl.cuts))
    storage = _faulty(root, plan)
    store = open_for_repair(storage)  # type: ignore[arg-type]
    try:
        _under_fault(storage, out, store.gc)
    finally:
        store.close()
    return out


def op_open(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """The writer open: lock, identity, recovery (gc of every leftover)."""
    out = Outcome(expect=dict(tpl.cuts))
    storage = _faulty(root, plan)
    _under_fault(storage, out, lambda: Store.open(storage))
    if out.result is not None:
        out.result.close()
    return out


def op_repair(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """What ``ckptstore repair`` does: open_for_repair, then repair(), both under the fault."""
    out = Outcome(expect=dict(tpl.cuts), repair_allowed=True)
    storage = _faulty(root, plan)

    def run() -> Any:
        with open_for_repair(storage) as store:  # type: ignore[arg-type]
            return store.repair()

    _under_fault(storage, out, run)
    return out


def _loaded_latest(out: Outcome, latest_step: int) -> None:
    """A load(fallback=True) that returned must have returned LATEST's state: every cut is intact, so
    falling back to an older one on a transient error silently demotes LATEST's cut."""
    if out.error is not None:
        return
    if not _equal(out.result, state(latest_step)):
        got = [s for s in range(1, latest_step) if _equal(out.result, state(s))]
        out.problems.append(
            f"load(fallback=True) returned the state of step {got[0] if got else '?'} instead of LATEST's "
            f"(step {latest_step}), although every cut is intact")


def op_load_writer(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    out = Outcome(expect=dict(tpl.cuts), no_bad=True)
    storage = _faulty(root, plan)
    store = Store.open(storage)
    try:
        _under_fault(storage, out, lambda: store.load(fallback=True))
    finally:
        store.close()
    _loaded_latest(out, max(tpl.cuts))
    return out


def op_load_readonly(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """ckptstore.load(storage, fallback=True): the readonly open and the load, both under the fault."""
    out = Outcome(expect=dict(tpl.cuts), no_bad=True)
    storage = _faulty(root, plan)
    _under_fault(storage, out, lambda: ckptstore.load(storage, fallback=True))  # type: ignore[arg-type]
    _loaded_latest(out, max(tpl.cuts))
    return out


def op_save_many(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """save(step=13) of many small arrays in three shards under the fault; then, without faults, 14, 15."""
    return _save_then_two_more(root, tpl, plan, 13, options=ckptstore.StoreOptions(max_shard_bytes=64 << 10))


def op_save_files(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """save(step=3, files=...) under the fault: a cut with attached files commits whole or not at all."""
    out = Outcome(expect=dict(tpl.cuts))
    storage = _faulty(root, plan)
    store = Store.open(storage)
    try:
        _under_fault(storage, out, lambda: store.save(state(3), step=3, files=[attach_src()]))
        if out.error is None:
            out.expect[3] = out.result.id
    finally:
        store.close()
    return out


def op_restore_files(root: str, tpl: Template, plan: FaultPlan) -> Outcome:
    """restore_files of LATEST's cut into an empty directory (readonly open and restore under the fault):
    it restores every file exactly or raises, and a file it leaves behind is never torn."""
    out = Outcome(expect=dict(tpl.cuts), no_bad=True)
    storage = _faulty(root, plan)
    dest = os.path.join(os.path.dirname(root), "restored")

    def run() -> Any:
        with Store.open(storage, readonly=True) as store:
            return store.restore_files(to=dest)

    _under_fault(storage, out, run)
    src = os.path.join(attach_src(), "..")
    for rel in ("attach-src/config.yaml", "attach-src/journal/000.log"):
        got = os.path.join(dest, rel)
        if os.path.exists(got):
            if open(got, "rb").read() != open(os.path.join(src, rel), "rb").read():
                out.problems.append(f"restore_files left a torn or wrong {rel}")
        elif out.error is None:
            out.problems.append(f"restore_files returned without writing {rel}")
    left = [f for _d, _s, fs in os.walk(dest) for f in fs if ".ckptstore-restore-" in f]
    if left:
        out.problems.append(f"restore_files left temporary files behind: {left}")
    return out


OPS: dict[str, tuple[Callable[[str, Template, FaultPlan], Outcome], str]] = {
    "save": (op_save, "cuts-1-2"),
    "save-many": (op_save_many, "many-11-12"),
    "prune": (op_prune, "cuts-1-5"),
    "gc": (op_gc, "leftovers"),
    "open": (op_open, "leftovers"),
    "repair": (op_repair, "no-latest"),
    "load-writer": (op_load_writer, "cuts-1-3"),
    "load-readonly": (op_load_readonly, "cuts-1-3"),
    "save-files": (op_save_files, "files-1-2"),
    "restore-files": (op_restore_files, "files-1-2"),
}


# --------------------------------------------------------------------------------------------------
# the check after each case


def _open_clean(root: str, out: Outcome) -> tuple[Store | None, str | None]:
    """The store opened as its writer without faults (recovery runs), LATEST readable; repaired first
    where the scenario began with a missing LATEST. Returns (store, None) or (None, why not)."""

    def plain() -> Store:
        store = Store.open(root)
        try:
            store.latest()  # LatestError when LATEST is missing or broken
        except BaseException:
            store.close()
            raise
        return store

    try:
        return plain(), None
    except LatestError as exc:
        if not out.repair_allowed:
            return None, f"the clean writer open after the fault failed: {normalize(repr(exc))}"
    except StoreLocked as exc:
        mine = exc.holder.get("pid") == os.getpid()
        return None, (f"the clean writer open after the fault failed: {normalize(repr(exc))}"
                      + (" (the holder named is this process)" if mine else ""))
    except Exception as exc:  # noqa: BLE001
        return None, f"the clean writer open after the fault failed: {normalize(repr(exc))}"
    try:
        with open_for_repair(root) as fixer:
            fixer.repair()
        return plain(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"the clean repair + writer open after the fault failed: {normalize(repr(exc))}"


def check_store(root: str, out: Outcome) -> list[str]:
    """Reopens the store cleanly as its writer (recovery runs) and lists every broken promise."""
    store, why = _open_clean(root, out)
    if store is None:
        return [why or "?"]
    problems: list[str] = []
    with store:
        latest = store.latest()
        top = max(out.expect)
        if latest is None or latest.step < top:
            problems.append(f"demoted: LATEST is step {latest.step if latest else None} although step {top} "
                            "was reported committed")
        for step, cut in sorted(out.expect.items()):
            try:
                value = store.load(cut)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"cut {step} lost: load({normalize(cut)}) raised {normalize(repr(exc))}")
                continue
            if not _equal(value, state(step)):
                problems.append(f"cut {step} loads values that differ from what was saved")
            try:
                report = store.verify(cut)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"cut {step}: verify({normalize(cut)}) raised {normalize(repr(exc))}")
                continue
            if not report.ok:
                problems.append(f"cut {step} fails verify: {[(f.kind, normalize(f.message)) for f in report.errors]}")
        report = store.verify()
        errors = [f for f in report.errors if f.cut is None or f.cut not in out.removed]
        if errors:
            problems.append("verify() of the store: " + "; ".join(
                f"{f.kind} {normalize(f.cut or '')}: {normalize(f.message)}" for f in errors))
    return problems


# --------------------------------------------------------------------------------------------------
# the cases


@dataclass(frozen=True)
class Case:
    op: str
    index: int | None  # None: the baseline without a fault; -1: the counting run itself failed
    after_effect: bool
    label: str  # the call that fails (normalized), or why counting failed
    id: str


def _fresh_copy(tpl: Template, dest: str) -> str:
    shutil.copytree(tpl.root, dest)
    return dest


def count_calls(op: str) -> list[Call]:
    """The counting run: the operation without a fault, every storage call logged."""
    scenario, tname = OPS[op]
    tpl = template(tname)
    work = tempfile.mkdtemp(dir=_base_dir(), prefix=f"count-{op}-")
    try:
        plan = FaultPlan()
        out = scenario(_fresh_copy(tpl, os.path.join(work, "store")), tpl, plan)
        if out.error is not None or out.problems:
            raise RuntimeError(f"the counting run of {op} failed without any fault: {out.error!r} {out.problems}")
        return plan.calls
    finally:
        shutil.rmtree(work, ignore_errors=True)


def all_cases() -> list[Case]:
    cases = []
    for op in OPS:
        cases.append(Case(op, None, False, "", f"{op}-baseline"))
        try:
            calls = count_calls(op)
        except Exception as exc:  # noqa: BLE001 - reported by the one case it leaves
            cases.append(Case(op, -1, False, repr(exc), f"{op}-counting-failed"))
            continue
        for c in calls:
            name = f"{op}-{c.index:03d}-{c.label}"
            cases.append(Case(op, c.index, False, c.label, name))
            if c.effect:
                cases.append(Case(op, c.index, True, c.label, f"{name}-after-effect"))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases = all_cases()
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_one_storage_fault_loses_no_committed_cut(case: Case, case_dir: str) -> None:
    if case.index == -1:
        pytest.fail(case.label, pytrace=False)
    scenario, tname = OPS[case.op]
    tpl = template(tname)
    root = _fresh_copy(tpl, os.path.join(case_dir, "store"))
    plan = FaultPlan(case.index, after_effect=case.after_effect)
    out = scenario(root, tpl, plan)

    if case.index is None:
        assert out.error is None and not out.problems, (out.error, out.problems)
        if case.op == "prune":
            assert {c.id for c in out.result} == out.removed
        if case.op == "gc":
            assert len(out.result.removed) == 8, out.result
    else:
        # test bugs, not library bugs: the sweep must hit exactly the call the counting run saw
        assert plan.fired is not None, f"the faulted run made fewer than {case.index + 1} storage calls"
        assert plan.fired.label == case.label, f"call {case.index} is {plan.fired.label}, counted {case.label}"

    problems: list[str] = []
    if out.error is not None and not isinstance(out.error, CkptStoreError):
        problems.append(f"{case.op} let a raw {type(out.error).__name__} out (not a ckptstore error): "
                        f"{normalize(repr(out.error))}")
    problems += out.problems
    if out.no_bad:
        bad = sorted(os.listdir(os.path.join(root, layout.BAD_DIR)))
        if bad:
            problems.append(f"an intact cut was recorded bad on a transient I/O error: bad/{[normalize(b) for b in bad]}")
    problems += check_store(root, out)
    if problems:
        did = "returned" if out.error is None else f"raised {type(out.error).__name__}: {normalize(str(out.error))}"
        mode = " (after its effect landed)" if case.after_effect else ""
        pytest.fail(f"EIO at call {case.index} {case.label}{mode} of {case.op}; {case.op} {did}\n  - "
                    + "\n  - ".join(problems), pytrace=False)


def test_faulty_storage_fails_exactly_one_call_as_the_backend_would(case_dir: str) -> None:
    """The wrapper itself: the chosen call raises the backend's StorageError (EIO, store, cut and path
    named), nothing happened on disk, and the same call works right after; uncounted while not recording."""
    root = _fresh_copy(template("cuts-1-2"), os.path.join(case_dir, "store"))
    plan = FaultPlan(1)
    storage = FaultyStorage(PosixStorage(root), plan)
    cut = template("cuts-1-2").cuts[2]
    storage.list_dir("cuts")  # not recording: not counted
    plan.recording = True
    storage.exists(layout.LATEST_FILE)
    with pytest.raises(ckptstore.StorageError) as info:
        storage.write_durably(layout.mark_path(cut), b"{}")
    assert info.value.errno == errno.EIO and isinstance(info.value, OSError)
    assert (info.value.store, info.value.cut, info.value.path) == (os.path.abspath(root), cut, layout.mark_path(cut))
    assert not os.path.exists(os.path.join(root, layout.mark_path(cut)))
    storage.delete(layout.mark_path(cut))  # the next call works again
    assert [c.label for c in plan.calls] == ["exists(LATEST)", "write_durably(marks/cut2.json)",
                                             "delete(marks/cut2.json)"]
    assert plan.fired == plan.calls[1]
