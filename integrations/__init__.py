"""ckptstore where trainers already live (imported as ``ckptstore.integrations``): the layer above the
store (``ckptstore``) and the writer (``ckptstore.writer``), which neither of them imports.

- :mod:`ckptstore.integrations.lightning`: ``CkptStoreCheckpointIO``, a Lightning CheckpointIO plugin.
- :mod:`ckptstore.integrations.transformers`: saving through the Checkpointer from a Hugging Face
  ``Trainer`` and resuming exactly.

Each module imports its framework when imported itself; this package imports nothing.
"""
