"""Putting saved DTensor shards (FSDP2, tensor parallel) back into live DTensors.

A cut stores each ``torch.distributed.tensor.DTensor`` as this rank's local shard plus a "dtensor" tree
node recording its layout (see ``ckptstore.tree.dtensor``); loading returns the plain local tensor, because
a reader has no device mesh. ``rewrap`` walks a loaded state dict alongside the live one (the model's or
optimizer's ``state_dict()``) and rebuilds a DTensor wherever the live value is one, on the live mesh
with the live placements. That is a per-rank restore: each rank reads the shard it wrote, so it needs
the same world size, mesh and placements as the save; any difference raises UsageError rather than
loading a wrong slice (resharding to another world size or mesh needs the DCP reader, a later feature).

torch is imported only inside the functions (``import ckptstore`` stays torch-free), and
torch.distributed only if the caller loaded it already.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Mapping

from .errors import UsageError
from .tree.dtensor import dtensor_layout
from .tree.nodes import key_path

RESHARD_HINT = ("a per-rank restore needs the world size, device mesh and placements of the save; resharding to a "
                "different world size/mesh needs the DCP reader (not supported yet)")


def dtensor_layouts(tree: Any) -> dict[str, dict[str, Any]]:
    """Leaf name -> "dtensor" node for every DTensor a manifest tree records (the first node naming a
    leaf, when shared references name it twice), in tree order: what was saved about each shard's
    global shape, offsets, placements and mesh."""
    out: dict[str, dict[str, Any]] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("t") == "dtensor" and isinstance(node.get("name"), str):
            out.setdefault(node["name"], node)
        items = node.get("items") if isinstance(node.get("items"), list) else []
        if node.get("t") == "dict":
            items = [item.get("v") for item in items if isinstance(item, dict)]
        stack.extend(reversed(items))
    return out


def node_at(tree: Any, *keys: Any) -> dict[str, Any] | None:
    """The tree node of the value at ``keys`` in a saved state (``node_at(manifest.tree, "model")``
    for ``state["model"]``), or None where the tree holds no such key. This is what ``rewrap``'s
    ``tree`` argument wants for a part of a loaded state."""
    node = tree
    for key in keys:
        if not isinstance(node, dict):
            return None
        items = node.get("items") if isinstance(node.get("items"), list) else []
        if node.get("t") == "dict":
            field = "k" if type(key) is str else "ik"
            node = next((it.get("v") for it in items if isinstance(it, dict) and field in it and it[field] == key), None)
        elif node.get("t") in ("list", "tuple") and type(key) is int and 0 <= key < len(items):
            node = items[key]
        else:
            return None
    return node if isinstance(node, dict) else None


def rewrap(loaded: Any, live: Any, *, where: dict[str, Any], tree: dict[str, Any] | None = None,
           prefix: tuple[Any, ...] = ()) -> Any:
    """``loaded`` with every value whose live counterpart is a DTensor made a DTensor again.

    ``loaded`` is (part of) a state that ``load`` returned; ``live`` the state dict of the same
    structure from the live object (``model.state_dict()``, ``optimizer.state_dict()`` of an FSDP2 or
    tensor-parallel model). Where the live value is a DTensor, the loaded tensor must have the live
    local shape and dtype, and becomes ``DTensor.from_local(loaded, live.device_mesh, live.placements,
    shape=live.shape, stride=live.stride())`` (moved to the live shard's device first; a Parameter stays
    a Parameter). Everything else passes through unchanged, as do keys the live state lacks (the
    object's own ``load_state_dict`` judges those).

    ``tree`` is the manifest tree node ``loaded`` was built from (``store.manifest(cut).tree``, or
    ``node_at(tree, "model")`` for ``state["model"]``). With it, each DTensor's saved global shape,
    offsets and placements are checked against the live layout too, and a saved shard that is not the
    whole tensor (sharded or partial) is refused where the live value is a plain tensor. Without it only
    local shape and dtype can be checked. ``where`` (store, cut) goes into the errors, and ``prefix``
    (the key path of ``loaded`` in the saved state, e.g. ``("model",)``) into the key they name.

    Raises UsageError naming the key on any mismatch: the live layout differs from the saved one.
    """
    rewrapper = _Rewrapper(where)
    if rewrapper.dtensor is None:  # no DTensor can be live; only the shard-into-plain check applies
        return rewrapper.walk(loaded, live, tree, tuple(prefix))
    # The shards are copied into the live state by load_state_dict: no autograd graph is wanted, and
    # to_local/from_local cost half as much without one.
    with rewrapper.torch.no_grad():  # type: ignore[union-attr]
        return rewrapper.walk(loaded, live, tree, tuple(prefix))


def restore_into(obj: Any, loaded: Any, *, where: dict[str, Any] | None = None, tree: dict[str, Any] | None = None,
                 prefix: tuple[Any, ...] = ()) -> Any:
    """``obj.load_state_dict(rewrap(loaded, obj.state_dict(), ...))``: restores a module (an FSDP2 one
    included) or an optimizer over DTensor parameters from a loaded state dict; returns what
    ``load_state_dict`` returns. ``where``, ``tree`` and ``prefix`` as for :func:`rewrap`.

    A freshly built optimizer has no state yet, so its ``state_dict()`` shows no DTensor to follow;
    for each parameter that is a DTensor and whose live state is missing, the loaded state's tensors
    take the parameter's layout: those the tree records as "dtensor" nodes (with ``tree``), or without
    it those with the parameter's local shape and at least one dimension (``step`` stays plain).
    """
    live = obj.state_dict()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.optim.Optimizer):
        live = _with_param_layouts(obj, live, loaded, tree)
    return obj.load_state_dict(rewrap(loaded, live, where=where or {}, tree=tree, prefix=prefix))


class _LayoutOf:
    """A live placeholder: "rebuild on ``dt``'s mesh and placements, keep the loaded dtype" (a missing
    optimizer state takes its parameter's layout; the optimizer casts the dtype itself)."""

    def __init__(self, dt: Any) -> None:
        self.dt = dt


def _with_param_layouts(opt: Any, live: dict[str, Any], loaded: Any, tree: dict[str, Any] | None) -> dict[str, Any]:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    saved_state = loaded.get("state") if isinstance(loaded, Mapping) else None
    if dtensor is None or not isinstance(saved_state, Mapping):
        return live
    torch = sys.modules["torch"]
    params = [p for group in opt.param_groups for p in group["params"]]
    ids = [i for group in live.get("param_groups", []) for i in group["params"]]
    state = dict(live.get("state", {}))
    for pid, param in zip(ids, params):
        entry = saved_state.get(pid)
        if pid in state or not isinstance(param, dtensor) or not isinstance(entry, Mapping):
            continue
        local_shape = tuple(param.to_local().shape)
        guesses: dict[Any, Any] = {}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or isinstance(value, dtensor):
                continue
            node = node_at(tree, "state", pid, key) if tree is not None else None
            if node is not None:
                take = node.get("t") == "dtensor"
            else:
                take = value.dim() > 0 and tuple(value.shape) == local_shape
            if take:
                guesses[key] = _LayoutOf(param)
        state[pid] = guesses
    return {**live, "state": state}


class _Rewrapper:
    def __init__(self, where: dict[str, Any]) -> None:
        self.where = where
        self.torch = sys.modules.get("torch")
        self.dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        self.layouts: dict[tuple[Any, ...], dict[str, Any]] = {}  # as tree.encode's flattener: ~100 us each
        self.meshes: dict[int, dict[str, Any]] = {}

    def layout(self, live: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        mesh = live.device_mesh
        key = (tuple(live.shape), tuple(live.stride()), id(mesh), tuple(live.placements))
        layout = self.layouts.get(key)
        if layout is None:
            layout = dtensor_layout(live, what=repr(key_path(path)), mesh_json=self.meshes.get(id(mesh)))
            self.layouts[key] = layout
            self.meshes[id(mesh)] = layout["mesh"]
        return layout

    def fail(self, path: tuple[Any, ...], msg: str) -> UsageError:
        return UsageError(f"cannot restore {key_path(path)!r}: {msg}", hint=RESHARD_HINT, **self.where)

    def walk(self, loaded: Any, live: Any, node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(live, _LayoutOf):
            return self.one(loaded, live.dt, node, path, same_dtype=False)
        if self.dtensor is not None and isinstance(live, self.dtensor):
            return self.one(loaded, live, node, path, same_dtype=True)
        if isinstance(loaded, dict) and isinstance(live, Mapping):
            children = _children(node)
            out: dict[Any, Any] = collections.OrderedDict() if isinstance(loaded, collections.OrderedDict) else {}
            for k, v in loaded.items():
                child = children.get((type(k) is str, k))
                out[k] = self.walk(v, live[k], child, path + (k,)) if k in live else v
            return out
        if type(loaded) in (list, tuple) and isinstance(live, (list, tuple)) and len(loaded) == len(live):
            items = node.get("items") if isinstance(node, dict) and isinstance(node.get("items"), list) else []
            out_items = [self.walk(v, lv, items[i] if i < len(items) else None, path + (i,))
                         for i, (v, lv) in enumerate(zip(loaded, live))]
            return out_items if type(loaded) is list else tuple(out_items)
        torch = self.torch
        if torch is not None and isinstance(live, torch.Tensor) and isinstance(node, dict) and node.get("t") == "dtensor":
            # A saved shard into a plain tensor: right only when the shard is the whole tensor.
            partial = any(isinstance(p, dict) and "partial" in p for p in node.get("placements", []))
            if partial or node.get("local_shape") != node.get("global_shape"):
                raise self.fail(path, f"the cut holds a shard {_describe_node(node)}, but the live value is a plain "
                                      f"tensor of shape {list(live.shape)}")
        return loaded

    def one(self, loaded: Any, live: Any, node: Any, path: tuple[Any, ...], *, same_dtype: bool) -> Any:
        torch, dtensor = self.torch, self.dtensor
        assert torch is not None and dtensor is not None
        if isinstance(loaded, dtensor):
            return loaded
        if not isinstance(loaded, torch.Tensor):
            raise self.fail(path, f"the live value is a DTensor but the cut holds a {type(loaded).__name__}")
        live_local = live.to_local()
        if tuple(loaded.shape) != tuple(live_local.shape) or (same_dtype and loaded.dtype != live.dtype):
            raise self.fail(path, f"the cut holds a {loaded.dtype} shard of shape {list(loaded.shape)}"
                                  f"{' ' + _describe_node(node) if _is_dtensor_node(node) else ''}, but the live DTensor "
                                  f"has a {live.dtype} local shard of shape {list(live_local.shape)} "
                                  f"{_describe_live(live, path)}")
        if _is_dtensor_node(node):
            layout = self.layout(live, path)
            for field in ("global_shape", "offsets", "placements"):
                if node.get(field) != layout[field]:
                    raise self.fail(path, f"the cut holds the shard {_describe_node(node)}, but on this rank the live "
                                          f"DTensor's is {_describe_node(layout)} ({field} do not match)")
        elif isinstance(node, dict) and node.get("t") == "tensor" and list(loaded.shape) != list(live.shape):
            raise self.fail(path, f"the cut holds a whole tensor of shape {list(loaded.shape)}, the live DTensor is "
                                  f"global {list(live.shape)}")
        param = isinstance(loaded, torch.nn.Parameter)
        local = loaded.detach() if param else loaded
        if local.device != live_local.device:
            local = local.to(live_local.device)
        out = dtensor.from_local(local, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                                 stride=live.stride())
        if param:
            out = torch.nn.Parameter(out, requires_grad=loaded.requires_grad)
        return out


def _children(node: Any) -> dict[tuple[bool, Any], Any]:
    """(key is str, key) -> child node of a "dict" tree node (str "1" and int 1 are different keys)."""
    if not isinstance(node, dict) or node.get("t") != "dict" or not isinstance(node.get("items"), list):
        return {}
    out: dict[tuple[bool, Any], Any] = {}
    for item in node["items"]:
        if isinstance(item, dict) and "k" in item:
            out[(True, item["k"])] = item.get("v")
        elif isinstance(item, dict) and "ik" in item:
            out[(False, item["ik"])] = item.get("v")
    return out


def _is_dtensor_node(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") == "dtensor"


def _describe_node(node: dict[str, Any]) -> str:
    return (f"(local {node.get('local_shape')} of global {node.get('global_shape')} at offsets {node.get('offsets')}, "
            f"placements {node.get('placements')})")


def _describe_live(live: Any, path: tuple[Any, ...]) -> str:
    try:
        return _describe_node(dtensor_layout(live, what=repr(key_path(path))))
    except Exception:  # the message must not fail for a layout ckptstore cannot record
        return f"(global {list(live.shape)}, placements {list(live.placements)})"
