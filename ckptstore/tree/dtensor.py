"""The "dtensor" node: how a ``torch.distributed.tensor.DTensor``'s layout is recorded (``dtensor_layout``,
``placement_json``, the save side) and checked when read (``check_dtensor_node``, used by the decoder and
so by load and verify alike). ``ckptstore.dtensors`` (the restore into live DTensors) computes the live
layout with the same ``dtensor_layout``, so what it compares is spelled as the node spells it.

Split out of tree.py (issue 20). torch is imported only inside ``dtensor_layout`` and ``placement_json``,
which run only for a state that holds DTensors; the checks run without torch.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedValue

_DTENSOR_KEYS = frozenset({"t", "name", "global_shape", "global_stride", "offsets", "local_shape", "placements",
                           "mesh", "param", "requires_grad"})
_MESH_KEYS = frozenset({"device_type", "shape", "ranks", "dim_names"})
_REDUCE_OP = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _int_list(v: Any, what: str, minimum: int) -> str | None:
    if type(v) is not list or any(type(n) is not int or n < minimum for n in v):
        return f"{what} is not a list of ints >= {minimum}"
    return None


def placement_json(p: Any, ndim: int) -> dict[str, Any] | None:
    """The JSON form of a DTensor placement, or None for one ckptstore cannot record: ``{"shard": d}``,
    ``{"strided_shard": d, "split_factor": k}``, ``{"replicate": true}``, ``{"partial": "sum"}`` (the
    reduce op). Exact types: a subclass (``_MaskPartial``...) carries state this form would drop."""
    from torch.distributed.tensor import placement_types as pt

    strided = getattr(pt, "_StridedShard", None)
    if strided is not None and type(p) is strided:
        return {"strided_shard": _dim(p.dim, ndim), "split_factor": int(p.split_factor)}
    if type(p) is pt.Shard:
        return {"shard": _dim(p.dim, ndim)}
    if type(p) is pt.Replicate:
        return {"replicate": True}
    if type(p) is pt.Partial and isinstance(p.reduce_op, str):
        return {"partial": p.reduce_op}
    return None


def _dim(d: int, ndim: int) -> int:
    return int(d) + ndim if d < 0 else int(d)


def dtensor_layout(dt: Any, *, what: str = "DTensor", mesh_json: dict[str, Any] | None = None) -> dict[str, Any]:
    """The layout fields of ``dt``'s "dtensor" node: ``global_shape``, ``global_stride``, this rank's
    ``offsets`` and ``local_shape`` (torch's ``compute_local_shape_and_global_offset``, what DCP records),
    ``placements`` and ``mesh`` (device type, shape, its global ranks row-major, dim names or None).
    ``mesh_json`` reuses an already computed mesh entry. Raises UnsupportedValue naming ``what`` for a
    placement it cannot record or a rank outside the mesh."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    global_shape = [int(n) for n in dt.shape]
    ndim = len(global_shape)
    encoded = [placement_json(p, ndim) for p in placements]
    if any(e is None for e in encoded):
        bad = [p for p, e in zip(placements, encoded) if e is None]
        raise UnsupportedValue(f"DTensor at {what} has placements {bad!r} that ckptstore cannot record "
                               "(Shard, _StridedShard, Replicate and Partial are supported)")
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if len(offsets) != ndim or len(local_shape) != ndim:
        raise UnsupportedValue(f"DTensor at {what}: this rank is not part of its device mesh")
    if mesh_json is None:
        names = mesh.mesh_dim_names
        mesh_json = {
            "device_type": str(mesh.device_type),
            "shape": [int(n) for n in mesh.shape],
            "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
            "dim_names": [str(n) for n in names] if names else None,
        }
    return {
        "global_shape": global_shape,
        "global_stride": [int(n) for n in dt.stride()],
        "offsets": [int(n) for n in offsets],
        "local_shape": [int(n) for n in local_shape],
        "placements": encoded,
        "mesh": mesh_json,
    }


def check_dtensor_node(node: Any) -> str | None:
    """Why a "dtensor" tree node is malformed, or None. Every field is type-checked (ints are never
    bools), sizes and offsets are non-negative and each shard lies inside the global shape, placements
    are one of the four recorded forms with a dim inside the tensor, there is one placement per mesh
    dimension, and the mesh lists one distinct rank per device. Unknown fields are refused."""
    if type(node) is not dict or node.get("t") != "dtensor":
        return "not a dtensor node"
    # In this order, each check relying on the ones before it (issue 20 split them out of one function).
    return _check_fields(node) or _check_mesh(node["mesh"]) or _check_placements(node)


def _check_fields(node: dict[str, Any]) -> str | None:
    """The node's own fields: names, the int lists of its layout and their bounds, the Parameter flags."""
    extra = set(node) - _DTENSOR_KEYS
    if extra:
        return f"unknown fields {sorted(extra)[:3]}"
    missing = sorted(_DTENSOR_KEYS - {"param", "requires_grad"} - set(node))
    if missing:
        return f"missing fields {missing}"
    if type(node["name"]) is not str or not node["name"]:
        return "name is not a non-empty str"
    for field, minimum in (("global_shape", 0), ("global_stride", 0), ("offsets", 0), ("local_shape", 0)):
        problem = _int_list(node[field], field, minimum)
        if problem:
            return problem
    shape, local, offsets = node["global_shape"], node["local_shape"], node["offsets"]
    if not len(node["global_stride"]) == len(offsets) == len(local) == len(shape):
        return "global_shape, global_stride, offsets and local_shape differ in length"
    if any(o + n > g for o, n, g in zip(offsets, local, shape)):
        return f"a shard of shape {local} at offsets {offsets} lies outside the global shape {shape}"
    for key in ("param", "requires_grad"):
        if key in node and type(node[key]) is not bool:
            return f"{key} is not a bool"
    if node.get("param") is False or ("requires_grad" in node and "param" not in node):
        return "requires_grad without param, or param false"
    return None


def _check_mesh(mesh: Any) -> str | None:
    """The mesh entry: exactly its four fields, one distinct rank per device, dim names or null."""
    if type(mesh) is not dict or set(mesh) != _MESH_KEYS:
        return f"mesh is not an object with exactly the fields {sorted(_MESH_KEYS)}"
    if type(mesh["device_type"]) is not str or not mesh["device_type"]:
        return "mesh device_type is not a non-empty str"
    if _int_list(mesh["shape"], "mesh shape", 1) or not mesh["shape"]:
        return "mesh shape is not a non-empty list of ints >= 1"
    if _int_list(mesh["ranks"], "mesh ranks", 0):
        return "mesh ranks is not a list of ints >= 0"
    devices = 1
    for n in mesh["shape"]:  # stops early: a hostile shape of huge ints never builds a huge product
        devices *= n
        if devices > len(mesh["ranks"]):
            break
    if len(mesh["ranks"]) != devices or len(set(mesh["ranks"])) != len(mesh["ranks"]):
        return f"mesh ranks are not {mesh['shape']} distinct ranks"
    names = mesh["dim_names"]
    if names is not None and (type(names) is not list or any(type(n) is not str for n in names)
                              or len(names) != len(mesh["shape"]) or len(set(names)) != len(names)):
        return "mesh dim_names is neither null nor one distinct str per mesh dimension"
    return None


def _check_placements(node: dict[str, Any]) -> str | None:
    """One valid placement per mesh dimension, and a dim no placement shards is whole in the shard.
    Runs after ``_check_fields`` and ``_check_mesh`` passed."""
    shape, local, offsets = node["global_shape"], node["local_shape"], node["offsets"]
    ndim = len(shape)
    placements = node["placements"]
    if type(placements) is not list or len(placements) != len(node["mesh"]["shape"]):
        return "placements is not a list with one entry per mesh dimension"
    sharded: set[int] = set()
    for p in placements:
        problem = _check_placement(p, ndim)
        if problem:
            return problem
        dim = p.get("shard", p.get("strided_shard"))
        if dim is not None:
            sharded.add(dim)
    for d in range(ndim):
        if d not in sharded and (local[d] != shape[d] or offsets[d] != 0):
            return f"dim {d} is not sharded, yet the shard is {local[d]} of {shape[d]} at offset {offsets[d]}"
    return None


def _check_placement(p: Any, ndim: int) -> str | None:
    if type(p) is not dict:
        return "a placement is not an object"
    keys = set(p)
    if keys == {"shard"} or keys == {"strided_shard", "split_factor"}:
        dim = p.get("shard", p.get("strided_shard"))
        if type(dim) is not int or not 0 <= dim < ndim:
            return f"placement {p!r} shards a dim outside the tensor's {ndim}"
        if "split_factor" in p and (type(p["split_factor"]) is not int or p["split_factor"] < 1):
            return f"placement {p!r} has a split_factor that is not an int >= 1"
        return None
    if keys == {"replicate"}:
        return None if p["replicate"] is True else f"placement {p!r} is not {{'replicate': true}}"
    if keys == {"partial"}:
        op = p["partial"]
        return None if type(op) is str and _REDUCE_OP.fullmatch(op) else f"placement {p!r} has no valid reduce op"
    return f"unknown placement {p!r}"


