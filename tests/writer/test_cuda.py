"""Capture of CUDA tensors: the device-copy path (clone on the device, copy to the pinned block on a side
stream) and the direct path (device-to-host into the block before capture returns). Either way the loop
may modify the tensors right after maybe_cut returns, and the cut loads back the old values.

Skipped where CUDA is missing (``-m cuda`` selects these on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from ckptstore import Store
from ckptstore.writer import Checkpointer
from writerkit import BOUND, EventLog, assert_state_equal

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    return {
        "w": torch.randn(512, 256, device="cuda", generator=g),
        "half": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
        "ids": torch.arange(4096, device="cuda", dtype=torch.int64),
        "cpu": torch.linspace(0, 1, 300),  # mixed with host tensors in one state
        "opt": {"m": torch.zeros(64, 64, device="cuda"), "t": torch.tensor(3, device="cuda")},
    }


def _to_cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    return {k: _to_cpu(v) for k, v in state.items()}


def _mutate(state) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1.0) if v.is_floating_point() else v.add_(1)
        else:
            _mutate(v)


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("device_copy,expected_mode", [(True, "cuda-device-copy"), (False, "cuda-direct")])
def test_cuda_capture_paths_take_a_snapshot(url, mode, device_copy, expected_mode):
    log = EventLog()
    state = _cuda_state()
    with Checkpointer(url, every=1, mode=mode, device_copy=device_copy, on_event=log) as ck:
        snaps, handles = [], []
        for step in (1, 2):
            snaps.append(_to_cpu(state))
            h = ck.maybe_cut(step, state) if step == 1 else ck.cut(step, state)
            _mutate(state)  # right after the call returns, on the loop's stream
            state["w"].mul_(-2.0)
            handles.append(h)
        infos = [h.wait(BOUND) for h in handles]
        for step in (1, 2):
            cap = log.of("captured", step=step)[0]
            if device_copy and cap["capture_mode"] == "cuda-direct":
                # The device-copy path is taken only with room on the device (2x the state + 1 GiB).
                assert "bytes free <" in cap["capture_reason"]
            else:
                assert cap["capture_mode"] == expected_mode, cap
    with Store.open(url, readonly=True) as store:
        assert store.verify().ok
        for info, snap in zip(infos, snaps):
            assert_state_equal(store.load(info.id), snap)  # loaded to the CPU
            on_gpu = store.load(info.id, map_location="cuda")
            assert on_gpu["w"].is_cuda and torch.equal(on_gpu["w"].cpu(), snap["w"])


def test_cuda_direct_reason_says_device_copy_disabled(url):
    log = EventLog()
    with Checkpointer(url, every=1, mode="inline", device_copy=False, on_event=log) as ck:
        ck.cut(1, {"x": torch.ones(10, device="cuda")}).wait(BOUND)
    cap = log.of("captured")[0]
    assert cap["capture_mode"] == "cuda-direct" and cap["capture_reason"] == "device copy disabled"
