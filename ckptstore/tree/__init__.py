"""The typed JSON tree of a state: what ``save`` stores instead of a pickle.

``flatten`` walks a state (dicts with str or int keys, lists, tuples, tensors, DTensors, numpy arrays,
python scalars, str, bytes, None, and the values of ``values.py``: paths, enums, dataclasses,
namedtuples, Namespaces, datetimes, sets, OmegaConf containers, classes) and returns a JSON tree plus
the list of array leaves, each named by its key path. Values it cannot store are collected, and one
UnsupportedValue lists them all with their key paths and why. ``unflatten`` rebuilds the same
structure with the same types. Every node is an object with a ``t`` kind; unknown kinds are refused on
load. Floats are stored as ``float.hex`` so they round-trip bit-exactly (nan payloads and -0.0 included).

A ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel) is stored as its rank's local shard (an
ordinary torch leaf) plus a "dtensor" node recording the layout: global shape and stride, the shard's
offsets and local shape (as DCP computes them), placements and mesh. A reader has no device mesh, so
the node loads back as the plain local tensor; ``ckptstore.dtensors.rewrap`` puts it back into a live
DTensor.

One module per noun (issue 20 split the 811-line tree.py; this package re-exports what callers import,
so ``from ckptstore.tree import ...`` is unchanged):

- ``nodes``    the array leaf, key paths, the depth bound, the walkers (``leaf_names``, ``children``)
- ``encode``   the save side: ``flatten`` (and the refusal message)
- ``decode``   the load side: ``unflatten`` and verify's ``check_tree``, one decoder per node kind
- ``views``    tensors sharing a storage saved as one array plus views; ``check_view``
- ``dtensor``  the "dtensor" node: recording a layout, and ``check_dtensor_node``

torch is never imported at import time: a state can only hold tensors if its caller imported torch
already, so ``sys.modules`` tells whether to look for them.
"""

from __future__ import annotations

from .decode import check_tree, plain_shape, unflatten
from .dtensor import check_dtensor_node, dtensor_layout, placement_json
from .encode import MAX_JSON_INT_BITS, MAX_LISTED, MAX_NAME, flatten, refusal_message
from .nodes import MAX_DEPTH, Leaf, children, has_pickle, key_path, leaf_names
from .views import MAX_VIEW_DIMS, check_view, share_storages

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_INT_BITS",
    "MAX_LISTED",
    "MAX_NAME",
    "MAX_VIEW_DIMS",
    "Leaf",
    "check_dtensor_node",
    "check_tree",
    "check_view",
    "children",
    "dtensor_layout",
    "flatten",
    "has_pickle",
    "key_path",
    "leaf_names",
    "placement_json",
    "plain_shape",
    "refusal_message",
    "share_storages",
    "unflatten",
]
