"""``map_location`` takes what ``torch.load`` takes (issue 13): a str, a torch.device, a dict, a callable
(Lightning passes ``lambda storage, loc: storage``), or None; anything else is a named UsageError."""

from __future__ import annotations

import pytest
import torch

import ckptstore


@pytest.fixture()
def url(tmp_path):
    u = str(tmp_path / "store")
    with ckptstore.Store.open(u, create=True) as s:
        s.save({"w": torch.arange(6.0), "p": torch.nn.Parameter(torch.ones(2))}, step=1)
    return u


@pytest.mark.parametrize("ml,device", [
    (None, "cpu"), ("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("meta", "meta"), (torch.device("meta"), "meta"),
    ({"cuda:0": "cpu"}, "cpu"), ({"cpu": "meta"}, "meta"),
    (lambda storage, loc: storage, "cpu"), (lambda storage, loc: None, "cpu"),
], ids=["none", "str", "device", "meta-str", "meta-device", "dict-other", "dict-cpu", "callable", "callable-none"])
def test_map_location_forms_of_torch_load(url, ml, device):
    out = ckptstore.load(url, map_location=ml)
    assert out["w"].device.type == device and out["p"].device.type == device
    assert isinstance(out["p"], torch.nn.Parameter)
    if device == "cpu":
        assert torch.equal(out["w"], torch.arange(6.0))


@pytest.mark.parametrize("ml", [3, {"cpu": 5}, lambda storage, loc: "cpu"], ids=["int", "dict-bad", "callable-bad"])
def test_a_map_location_torch_load_would_refuse_is_a_named_usage_error(url, ml):
    with pytest.raises(ckptstore.UsageError, match="map_location") as exc:
        ckptstore.load(url, map_location=ml)
    assert exc.value.store == url
