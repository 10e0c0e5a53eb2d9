"""ckptstore where trainers already live (imported as ``ckptstore.integrations``): the layer above the
store (``ckptstore``) and the writer (``ckptstore.writer``), which neither of them imports.

- :mod:`ckptstore.integrations.dcp`: ``StoreWriter``/``StoreReader``, ckptstore as a storage backend of
  ``torch.distributed.checkpoint`` (it was ``ckptstore.dcp`` before issue 20).
- :mod:`ckptstore.integrations.lightning`: ``CkptStoreCheckpointIO``, a Lightning CheckpointIO plugin.
- :mod:`ckptstore.integrations.transformers`: saving through the Checkpointer from a Hugging Face
  ``Trainer`` and resuming exactly.

Each module imports its framework when its framework's names are first used (dcp's when one of them is
looked up, the others when imported); this package imports nothing.
"""

#: For each manifest ``metadata`` key an integration writes, its torch-free module that registers
#: ``verify``'s check of that key (``ckptstore.metachecks``). ``verify`` imports the module the first
#: time it meets the key, so ``ckptstore verify`` reports the integration's notices in a process that
#: never imported the integration, without torch (issue 20: the store layer names no integration).
METADATA_CHECKS = {
    "ckptstore.dcp": "ckptstore.integrations.dcp.checks",
}
