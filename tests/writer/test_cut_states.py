"""The cut state machine (CutHandle) and what close() reports when cleanup fails after a final cut."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from ckptstore import CutInfo
from ckptstore.writer import Checkpointer, CutHandle, IllegalTransition, WriterError
from writerkit import BOUND, check_store, has_exited, small_state, wait_until


def _info(cut: str = "step-000000000001-00000000", step: int = 1) -> CutInfo:
    return CutInfo(id=cut, step=step, tags=(), created_at=datetime.now(timezone.utc), nbytes=0, final=False,
                   files=0, tensors=0, metadata={})


def test_legal_path_to_committed():
    info = _info()
    h = CutHandle(1, info.id, final=False)
    assert h.state == "capturing" and not h.done
    h.to_writing()
    h.to_committing()
    assert not h.done
    h.to_committed(info)
    assert h.state == "committed" and h.done and h.wait(0) is info and h.error is None


def test_wait_times_out_on_a_cut_in_flight():
    h = CutHandle(3, "step-000000000003-00000000", final=False)
    h.to_writing()
    with pytest.raises(TimeoutError, match="still writing"):
        h.wait(0.01)


@pytest.mark.parametrize("path,illegal", [
    ((), "to_committing"),                                   # capturing -> committing skips writing
    ((), "to_committed"),
    (("to_writing",), "to_committed"),                       # writing -> committed skips committing
    (("to_writing", "to_committing"), "to_writing"),         # backwards
    (("to_writing", "to_committing"), "to_aborted"),         # a cut being committed cannot be aborted
    (("to_writing", "to_committing", "to_committed"), "to_committed"),  # committing twice
    (("to_writing", "to_committing", "to_committed"), "to_failed"),     # a committed cut cannot fail
    (("to_writing", "to_committing", "to_committed"), "to_writing"),
    (("to_writing", "to_failed"), "to_committing"),
    (("to_writing", "to_failed"), "to_committed"),           # a failed cut never becomes committed
    (("to_writing", "to_failed"), "to_failed"),
    (("to_aborted",), "to_writing"),
])
def test_illegal_transitions_raise_and_change_nothing(path, illegal):
    info = _info()
    h = CutHandle(1, info.id, final=False)
    first_error = RuntimeError("first failure")
    args = {"to_committed": (info,), "to_failed": (first_error,), "to_aborted": ("closing",)}
    for name in path:
        getattr(h, name)(*args.get(name, ()))
    before = (h.state, h.done, h.error)
    other_info = _info("step-000000000009-ffffffff", 9)
    other = {"to_committed": (other_info,), "to_failed": (RuntimeError("late failure"),),
             "to_aborted": ("late",)}
    with pytest.raises(IllegalTransition) as err:
        getattr(h, illegal)(*other.get(illegal, ()))
    assert err.value.cut == h.id and err.value.step == 1
    assert isinstance(err.value, WriterError)
    # Terminal outcomes never change: not the state, not the error, not the committed CutInfo.
    assert (h.state, h.done, h.error) == before
    if h.state == "committed":
        assert h.wait(0) is info
    elif h.state == "failed":
        with pytest.raises(RuntimeError, match="first failure"):
            h.wait(0)


def test_committed_handle_from_a_real_cut_refuses_a_second_commit_or_failure(url):
    with Checkpointer(url, every=1, mode="thread") as ck:
        h = ck.cut(1, small_state())
        info = h.wait(BOUND)
        with pytest.raises(IllegalTransition):
            h.to_committed(info)
        with pytest.raises(IllegalTransition):
            h.to_failed(RuntimeError("cleanup retried after commit"))
        assert h.state == "committed" and h.wait(0) is info
        # Nor does the checkpointer pick up an error from it at the next call.
        assert ck.cut(2, small_state()).wait(BOUND).step == 2


def test_close_failure_after_final_cut_is_reported_and_final_stays_committed(url, monkeypatch):
    def broken_close_writer(self):
        raise OSError("writer would not shut down")

    with Checkpointer(url, every=1) as ck:  # process mode: there is a writer to close
        pid = ck.writer_pid
        final = ck.cut(5, small_state(), final=True)
        assert final.state == "committed"
        monkeypatch.setattr(Checkpointer, "_close_writer", broken_close_writer)
        try:
            with pytest.raises(WriterError) as err:
                ck.close()
        finally:
            monkeypatch.undo()
            ck._close_writer()  # the real one: do not leave the writer running
        msg = str(err.value)
        assert "closing the checkpointer failed" in msg and "writer would not shut down" in msg
        assert f"the final cut {final.id} is committed and unaffected" in msg
        assert isinstance(err.value.__cause__, OSError)
        assert final.state == "committed" and final.wait(0).final is True
    wait_until(lambda: has_exited(pid), what="writer exit")
    store = check_store(url)
    assert store.latest().id == final.id and store.latest().final


def test_the_old_committer_module_is_a_deprecated_shim_of_handle(monkeypatch):
    """Issue 20: committer.py became handle.py (its docstring claimed the commit thread, which lives in
    pipeline.py); the old path keeps working for one release and says so."""
    import importlib
    import sys

    import ckptstore.writer.handle as handle

    monkeypatch.delitem(sys.modules, "ckptstore.writer.committer", raising=False)
    with pytest.warns(DeprecationWarning, match="ckptstore.writer.committer is deprecated"):
        old = importlib.import_module("ckptstore.writer.committer")
    assert old.CutHandle is handle.CutHandle is CutHandle
    assert old.elapsed is handle.elapsed and old.TERMINAL is handle.TERMINAL
