"""Values without pickle (issue 13): the paths, enums, dataclasses, namedtuples, Namespaces, datetimes,
sets, OmegaConf configs and classes that hyperparameters hold round-trip as typed tree nodes, through
``Store.save`` and a thread-mode Checkpointer. User classes come back as themselves only when named in
``allowed_types``, otherwise in the plain shapes docs/format.md documents; nothing is imported by a
name the store holds; verify refuses a malformed node exactly where a load does; and a refused save
lists every value it refused, with its key and why."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import enum
import json
import os
import pathlib
import sys
import typing
from typing import Any, Callable

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

import ckptstore
from filekit import rewrite_manifest
from ckptstore import CorruptCut, Store, UnsupportedValue, UsageError
from ckptstore.tree import flatten

HERE = __name__  # the module part of the qualified names below


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


class Perm(enum.Flag):
    R = 1
    W = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Inner:
    depth: int
    color: Color


@dataclasses.dataclass(frozen=True)
class OptimCfg:
    lr: float = 0.1
    betas: tuple = (0.9, 0.999)
    inner: Inner = dataclasses.field(default_factory=lambda: Inner(2, Color.BLUE))
    steps: int = dataclasses.field(default=0, init=False)


Point = collections.namedtuple("Point", "x y")


class Span(typing.NamedTuple):
    lo: int
    hi: Color


ALLOWED = [Color, Perm, Level, Inner, OptimCfg, Point, Span, DictConfig, ListConfig]
TZ = dt.timezone(dt.timedelta(hours=-3, minutes=-30))


def _cfg() -> OptimCfg:
    cfg = OptimCfg(lr=0.5)
    object.__setattr__(cfg, "steps", 7)  # a non-init field that differs from its default
    return cfg


def values() -> dict[str, Any]:
    """One of every value kind, each also nested inside dicts and lists."""
    return {
        "path": pathlib.Path("/data/run 1/ckpt"),
        "pure": pathlib.PurePosixPath("rel/x"),
        "win": pathlib.PureWindowsPath(r"C:\data\x"),
        "color": Color.RED,
        "perm": Perm.R | Perm.W,
        "no_perm": Perm(0),  # a Flag pseudo-member without a name
        "level": Level.HIGH,
        "cfg": _cfg(),
        "point": Point(1, [2.5, "y"]),
        "span": Span(3, Color.BLUE),
        "ns": argparse.Namespace(lr=0.1, out=pathlib.Path("out"), nested=argparse.Namespace(a=1)),
        "when": dt.datetime(2024, 3, 31, 1, 30, 0, 5, tzinfo=TZ),
        "naive": dt.datetime(2024, 11, 3, 1, 30, fold=1),
        "day": dt.date(1999, 12, 31),
        "clock": dt.time(23, 59, 59, 999999, tzinfo=dt.timezone.utc),
        "delta": dt.timedelta(days=-2, seconds=5, microseconds=7),
        "set": {3, 1, 2},
        "frozen": frozenset({"b", "a", Color.BLUE, (1, "x")}),
        "empty": set(),
        "omega": OmegaConf.create({"model": {"lr": 0.1, "dim": 8}, "opt": {"lr": "${model.lr}"}, "miss": "???"}),
        "omega_list": OmegaConf.create([1, {"a": Color.RED}]),
        "type": OptimCfg,
        "builtin_type": int,
        "nested": {"list": [Color.BLUE, pathlib.Path("a"), {"d": dt.date(2020, 1, 1)}], "tuple": (Point(0, 0),)},
    }


PLAIN = {  # what a load without allowed_types gives for the user classes above
    "color": "red",
    "perm": 3,
    "no_perm": 0,
    "level": 2,
    "cfg": {"lr": 0.5, "betas": (0.9, 0.999), "inner": {"depth": 2, "color": 2}, "steps": 7},
    "point": (1, [2.5, "y"]),
    "span": (3, 2),
    "frozen": frozenset({"b", "a", 2, (1, "x")}),
    "omega": {"model": {"lr": 0.1, "dim": 8}, "opt": {"lr": "${model.lr}"}, "miss": "???"},
    "omega_list": [1, {"a": "red"}],
    "type": f"{HERE}.OptimCfg",
    "nested": {"list": [2, pathlib.Path("a"), {"d": dt.date(2020, 1, 1)}], "tuple": ((0, 0),)},
}


def assert_exact(a: Any, b: Any, where: str = "") -> None:
    """Equal, and of exactly the same type all the way down."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, (DictConfig, ListConfig)):
        assert OmegaConf.to_container(a) == OmegaConf.to_container(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_exact(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_exact(x, y, f"{where}/{i}")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            assert_exact(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, argparse.Namespace):
        assert_exact(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)
        if isinstance(a, (dt.datetime, dt.time)):
            assert a.fold == b.fold and a.utcoffset() == b.utcoffset(), where


def test_every_value_round_trips_without_pickle(store: Store) -> None:
    state = {"hp": values(), "w": torch.arange(3.0), "in_list": [values()]}
    info = store.save(state, step=1)
    assert not store.manifest(info.id).pickled
    assert store.verify().ok
    assert_exact(ckptstore.load(store.url, allowed_types=ALLOWED)["hp"], state["hp"])
    out = store.load(allowed_types=ALLOWED)
    assert_exact(out["in_list"][0], state["hp"])
    assert torch.equal(out["w"], torch.arange(3.0))
    # allow_pickle changes nothing for them: they are tree nodes, never pickles.
    assert not store.manifest(store.save(state, step=2, allow_pickle=True).id).pickled


def test_without_allowed_types_user_classes_come_back_in_their_plain_shapes(store: Store) -> None:
    store.save({"hp": values()}, step=1)
    out = ckptstore.load(store.url)["hp"]
    expected = {**values(), **PLAIN}
    assert_exact(out, expected)
    # The plain shapes chosen: an IntEnum's value equals its member; a namedtuple's tuple equals it.
    assert out["level"] == Level.HIGH and out["point"] == Point(1, [2.5, "y"])
    assert Color(out["color"]) is Color.RED and OptimCfg.__name__ in out["type"]
    # Allowing only some classes: the others stay plain, nested ones included.
    part = ckptstore.load(store.url, allowed_types=[Inner])["hp"]
    assert part["cfg"]["inner"] == Inner(2, 2) and part["color"] == "red"


def test_a_windows_path_loads_as_its_pure_class_on_posix(store: Store) -> None:
    if os.name == "nt":
        pytest.skip("POSIX only")
    store.save({"p": pathlib.PureWindowsPath("C:/x")}, step=1)
    # What a save on Windows writes for Path("C:/x").
    rewrite_manifest(store.url, store.manifest().cut, lambda doc: doc["tree"]["items"][0]["v"].update(type="WindowsPath"))
    assert ckptstore.load(store.url)["p"] == pathlib.PureWindowsPath("C:/x")
    assert type(ckptstore.load(store.url)["p"]) is pathlib.PureWindowsPath


def test_a_thread_mode_checkpointer_stores_them_too(tmp_path) -> None:
    from ckptstore.writer import Checkpointer

    url = str(tmp_path / "store")
    state = {"model": {"w": torch.ones(4)}, "hparams": values()}
    with Checkpointer(url, every=1, mode="thread") as ck:
        ck.cut(1, state).wait(30.0)
    with Store.open(url, readonly=True) as s:
        assert s.verify().ok and not s.manifest().pickled
    assert_exact(ckptstore.load(url, allowed_types=ALLOWED)["hparams"], state["hparams"])
    resumed = ckptstore.restore(url, allowed_types=ALLOWED)
    assert resumed is not None and resumed.state["hparams"]["color"] is Color.RED


def test_lightning_like_hparams_round_trip(store: Store) -> None:
    """What Lightning's checkpoint connector stores for an OmegaConf module: the DictConfig and its class."""
    hp = {"lr": 0.1, "path": pathlib.Path("/data"), "color": Color.RED, "ns": argparse.Namespace(a=1),
          "cfg": OmegaConf.create({"layers": 4, "act": "relu"})}
    ckpt = {"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": hp, "hparams_type": DictConfig}
    store.save(ckpt, step=1)
    out = ckptstore.load(store.url, allowed_types=[Color, DictConfig])
    assert out["hparams_type"] is DictConfig
    assert_exact(out["hyper_parameters"], hp)
    plain = ckptstore.load(store.url)
    assert plain["hparams_type"] == "omegaconf.dictconfig.DictConfig"  # Lightning then uses an AttributeDict
    assert plain["hyper_parameters"]["cfg"] == {"layers": 4, "act": "relu"}


def test_sets_are_stored_in_a_deterministic_order() -> None:
    a = frozenset(["b", "a", "c"])
    tree, _ = flatten({"s": a, "m": {3, "x", (1, 2), Color.BLUE, None}})
    assert [n["v"] for n in tree["items"][0]["v"]["items"]] == ["a", "b", "c"]
    mixed = [3, "x", (1, 2), Color.BLUE, None]
    orders = {json.dumps(flatten(set(mixed[i:] + mixed[:i]))[0]) for i in range(len(mixed))}
    assert len(orders) == 1


# ------------------------------------------------------------------------------------ never imported
def test_a_class_named_in_the_store_is_never_imported(store: Store, tmp_path, monkeypatch) -> None:
    canary = tmp_path / "imported.txt"
    (tmp_path / "canarymod.py").write_text(
        f"open({str(canary)!r}, 'w').write('imported')\n"
        "import enum\nclass Evil(enum.Enum):\n    RED = 'red'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    store.save({"c": Color.RED, "k": OptimCfg, "d": Inner(1, Color.RED), "p": Point(1, 2)}, step=1)
    m = store.manifest()

    def plant(doc: dict[str, Any]) -> None:
        for item in doc["tree"]["items"]:
            item["v"]["type"] = "canarymod.Evil"

    rewrite_manifest(store.url, m.cut, plant)
    with Store.open(store.url, readonly=True) as ro:
        assert ro.verify().ok
    out = ckptstore.load(store.url, allowed_types=ALLOWED)
    assert out == {"c": "red", "k": "canarymod.Evil", "d": {"depth": 1, "color": Color.RED}, "p": (1, 2)}
    assert not canary.exists() and "canarymod" not in sys.modules


# --------------------------------------------------------------------------------------- allowed_types
def test_allowed_types_takes_a_list_of_classes_only(store: Store) -> None:
    store.save({"c": Color.RED}, step=1)
    for bad in (Color, "tests.Color", [Color.RED], [Color, "x"], 3):
        with pytest.raises(UsageError, match="allowed_types"):
            ckptstore.load(store.url, allowed_types=bad)


def test_an_allowed_class_that_does_not_fit_its_node_is_corrupt(store: Store) -> None:
    store.save({"c": Color.RED, "d": Inner(1, Color.RED), "p": Point(1, 2)}, step=1)

    def impostor(qualname: str, make: Callable[[], type]) -> type:
        cls = make()
        cls.__module__, cls.__qualname__ = HERE, qualname
        return cls

    no_red = impostor("Color", lambda: enum.Enum("Color", {"BLUE": 2}))
    other_fields = impostor("Inner", lambda: dataclasses.make_dataclass("Inner", ["depth", "shade"]))
    other_point = impostor("Point", lambda: collections.namedtuple("Point", "y x"))
    not_enum = impostor("Color", lambda: type("Color", (), {}))
    for cls, words in [(no_red, "no member 'RED'"), (other_fields, "fields"), (other_point, "fields"),
                       (not_enum, "not an Enum")]:
        # the cut is fine, the caller's class changed: a UsageError, so no fallback ever records the cut bad
        with pytest.raises(UsageError, match=words) as exc:
            ckptstore.load(store.url, allowed_types=[cls])
        assert exc.value.store == store.url and exc.value.cut is not None
    assert ckptstore.load(store.url)["c"] == Color.RED.value  # and without it, the plain value


# ----------------------------------------------------------------------------------------- refusals
class Custom:
    pass


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and nested tensors are deprecated or prototype
def test_a_refusal_lists_every_refused_value_with_its_key_and_why(store: Store, tmp_path) -> None:
    sparse = torch.eye(3).to_sparse()
    with open(tmp_path / "f.txt", "w") as fh:
        q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        bad = {"model": {"emb": sparse, "ok": torch.ones(1), "q": q, "nt": nested},
               "hp": {"fn": lambda x: x, "obj": Custom(), "file": fh, 2.5: "float key"},
               "s": {frozenset({1}), Frozen(1)}, "ok": Color.RED}
        with pytest.raises(UnsupportedValue) as ei:
            store.save(bad, step=1)
    text = str(ei.value)
    for key, why in [("model/emb", "sparse tensor (layout torch.sparse_coo): call .to_dense()"),
                     ("hp/fn", "a lambda"), ("hp/obj", f"{HERE}.Custom (not a dataclass, enum or namedtuple)"),
                     ("hp/file", "an open file"), ("hp", "dict key 2.5 is a float"),
                     ("s/{}", "not hashable in its plain shape"), ("model/q", "quantized tensor"),
                     ("model/nt", "nested tensor")]:
        assert f"'{key}': " in text and why in text, (key, why, text)
    assert "cannot store 8 values" in text and store.cuts() == []
    many = {f"k{i}": Custom() for i in range(25)}
    with pytest.raises(UnsupportedValue, match="and 5 more"):
        store.save(many, step=1)


def test_a_tensor_inside_a_set_element_is_refused(store: Store) -> None:
    with pytest.raises(UnsupportedValue, match="set element holds an array"):
        store.save({"s": {(1, torch.ones(1))}}, step=1)


# ---------------------------------------------------------------------- verify refuses what load does
def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda node: node.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda node: node.pop(key)


CRAFTED = [  # (value saved, how its node is broken)
    (pathlib.Path("a"), _set("type", "EvilPath")),
    (pathlib.Path("a"), _set("v", 3)),
    (pathlib.Path("a"), _set("extra", 1)),
    (dt.datetime(2024, 1, 1), _set("v", "2024-13-01T00:00:00")),
    (dt.datetime(2024, 1, 1), _set("v", "20240101T000000")),  # parses on 3.11, not what isoformat writes
    (dt.datetime(2024, 1, 1), _set("fold", 2)),
    (dt.date(2024, 1, 1), _set("fold", 1)),
    (dt.time(1, 2), _set("v", "x" * 100)),
    (dt.timedelta(1), _set("seconds", 86400)),
    (dt.timedelta(1), _set("days", 10**12)),
    (dt.timedelta(1), _set("days", True)),
    ({1, 2}, _set("items", [{"t": "list", "items": []}])),  # unhashable element
    (frozenset({1}), _set("items", {"t": "int", "v": 1})),
    (Color.RED, _set("type", "os.system; rm")),
    (Color.RED, _set("name", 3)),
    (Color.RED, _drop("value")),
    (Color.RED, _set("value", {"t": "nope"})),
    (OptimCfg(), _set("fields", ["lr", "lr", "inner", "steps"])),
    (OptimCfg(), _set("fields", ["lr"])),
    (OptimCfg(), _set("type", 7)),
    (Point(1, 2), _set("items", [{"t": "int", "v": 1}])),
    (argparse.Namespace(a=1), _set("fields", [1])),
    (argparse.Namespace(a=1), _set("type", "x.Y")),
    (OptimCfg, _set("type", "")),
    (OmegaConf.create({"a": 1}), _set("type", "omegaconf.listconfig.ListConfig")),
    (OmegaConf.create({"a": 1}), _set("value", {"t": "int", "v": 1})),
    (OmegaConf.create({"a": 1}), _set("type", "collections.OrderedDict")),
]


def test_verify_refuses_a_malformed_node_exactly_where_a_load_raises(tmp_path) -> None:
    url = str(tmp_path / "store")
    cuts = []
    with Store.open(url, create=True) as s:
        for step, (value, _) in enumerate(CRAFTED):
            cuts.append(s.save({"v": value, "w": torch.ones(2)}, step=step).id)
        assert s.verify().ok  # every kind, before it is broken
    for cut, (_, breaks) in zip(cuts, CRAFTED):
        rewrite_manifest(url, cut, lambda doc: breaks(doc["tree"]["items"][0]["v"]))
    with Store.open(url, readonly=True) as ro:
        report = ro.verify()
    bad = {f.cut for f in report.findings if f.kind == "tree-invalid"}
    for cut, (value, _) in zip(cuts, CRAFTED):
        with pytest.raises(CorruptCut):
            ckptstore.load(url, cut=cut, allowed_types=ALLOWED)
        with pytest.raises(CorruptCut):
            ckptstore.load(url, cut=cut)
        assert cut in bad, (cut, value)
