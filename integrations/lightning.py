"""A Lightning ``CheckpointIO`` plugin: every checkpoint Lightning writes is a cut of a ckptstore store.

```python
from ckptstore.integrations.lightning import CkptStoreCheckpointIO
trainer = lightning.Trainer(plugins=[CkptStoreCheckpointIO()],
                            callbacks=[ModelCheckpoint(dirpath=d, save_top_k=2, save_last=True)])
trainer.fit(model, ckpt_path=path)   # any path Lightning reported (last_model_path, best_model_path)
```

**Paths onto cuts.** The directory of a checkpoint path (``ModelCheckpoint``'s ``dirpath``) is the store;
the file name (``epoch=3-step=120.ckpt``, ``last.ckpt``) is a *label* of the cut (``Store.label``). A
fit *stands on* a cut: the one it last saved or labelled, or after a resume the one it loaded. A save
at that cut's step only labels it (ModelCheckpoint's second path of a step, ``trainer.save_checkpoint``
after the fit); every other save writes a new cut (``Store.save`` of the whole checkpoint dict, without
pickle), even at a step the store holds already: a cut at LATEST's step is not this fit's for that
(issue 19 item 1). Lightning's ``remove_checkpoint`` (``save_top_k`` dropping a worse checkpoint, a
moved ``last``) removes the label, and the cut goes when no label names it any more and it is not
LATEST's (``Store.remove``, under prune's rules): a cut lives as long as a name Lightning holds, as its
file would.

**Resuming from an older path** (``best_model_path`` while ``last`` is newer) and training on: the
first save at or below LATEST's step points LATEST back at the cut the fit resumed from (so the new
steps are above it) and writes its cuts from there, LATEST's own step included; a fit that stands on
no cut of the store at or below the step it saves gets ``StepConflict``. Cuts of the abandoned
continuation stay while a label still names them (Lightning's restored ``ModelCheckpoint`` no longer
tracks them, just as it would leave their files on disk), and a name saved again moves to the new cut,
so an old cut goes once none of its names is left.

**Loading outside a Trainer.** ``LightningModule.load_from_checkpoint(path)`` reads the file itself and
cannot be routed through a plugin; use :func:`load_checkpoint` (the same dict Lightning would read),
then ``Model(**ckpt["hyper_parameters"])`` and ``model.load_state_dict(ckpt["state_dict"])``.

**Several processes.** Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0
only (``Strategy.save_checkpoint``; FSDP's sharded, ModelParallel's distributed and DeepSpeed's
checkpoints bypass the CheckpointIO), and ``load_checkpoint`` on every rank. So under DDP rank 0 is
the store's one writer and the other ranks read it, readonly, without the lock; Lightning's barrier
after loading (``_CheckpointConnector.resume_end``) keeps those reads before rank 0's next write. No
strategy hands every rank's part to the CheckpointIO, so there is no ``group=`` here: a collective
Checkpointer opened by rank 0 alone would wait for ranks that never come. docs/integrations.md has
the details.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptstore import CkptStoreError, CutInfo, Store, StoreOptions, UsageError
from ckptstore import spi
from ckptstore.errors import StepConflict, StoreNotFound

log = logging.getLogger("ckptstore.integrations.lightning")

#: Tag on every cut this plugin writes.
TAG = "lightning"


def split_path(path: str | os.PathLike) -> tuple[str, str]:
    """(store URL, label) of a checkpoint path: its directory and its file name. fsspec URLs keep their
    protocol; local paths are made absolute (Lightning hands over both forms for one directory)."""
    text = os.fspath(path)
    if "://" in text:
        root, _, name = text.rstrip("/").rpartition("/")
        return root, name
    text = os.path.abspath(text)
    return os.path.dirname(text), os.path.basename(text)


def _store_root(url: str | os.PathLike) -> str:
    """A store directory's URL in :func:`split_path`'s form (one key for one store)."""
    text = os.fspath(url)
    return text.rstrip("/") if "://" in text else os.path.abspath(text)


def load_checkpoint(path: str | os.PathLike, *, map_location: Any = "cpu", allowed_types: Iterable[type] = (),
                    storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint dict saved under ``path`` by :class:`CkptStoreCheckpointIO`, read from its store
    without a Trainer (``load_from_checkpoint`` cannot be routed through a plugin). ``path`` may also
    be the store directory itself: then its LATEST cut. Raises ``FileNotFoundError`` naming the store
    and its labels when no cut is labelled so."""
    root, name = split_path(path)
    options = StoreOptions(storage_options=storage_options)
    if _is_store(os.fspath(path), options):
        with Store.open(os.fspath(path), readonly=True, options=options) as store:
            return _load(store, "latest", map_location, allowed_types)
    with Store.open(root, readonly=True, options=options) as store:
        return _load(store, _resolve(store, name, root), map_location, allowed_types)


def _is_store(url: str, options: StoreOptions) -> bool:
    try:
        Store.open(url, readonly=True, options=options).close()
        return True
    except CkptStoreError:
        return False


def _latest_id(store: Store) -> str:
    latest = store.latest()
    return "latest" if latest is None else latest.id  # "latest" of an empty store: load's own error


def _resolve(store: Store, name: str, root: str) -> str:
    cut = store.labels().get(name)
    if cut is None:
        known = sorted(store.labels())
        raise FileNotFoundError(f"no checkpoint {name!r} in the ckptstore store {root} (its labels: "
                                f"{', '.join(known[:10]) or 'none'}{' ...' if len(known) > 10 else ''})")
    return cut


def _load(store: Store, cut: str, map_location: Any, allowed_types: Iterable[type]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if allowed_types:
        kw["allowed_types"] = list(allowed_types)
    state = store.load(cut, map_location=map_location, **kw)
    if not isinstance(state, dict):
        raise UsageError(f"cut {cut} does not hold a Lightning checkpoint dict", store=store.url, cut=cut)
    return state


class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` over ckptstore stores (see the module docstring).

    ``store_options``: how stores are created and opened (compression, shard size, fsspec options).
    ``allowed_types``: user classes (enums, dataclasses, namedtuples) the loaded hyperparameters may
    come back as (``ckptstore.load(..., allowed_types=)``). The plugin holds each store's writer lock
    from its first save until ``teardown`` (the end of ``fit``).
    """

    def __init__(self, *, store_options: StoreOptions | None = None, allowed_types: Iterable[type] = ()) -> None:
        self.store_options = store_options
        self.allowed_types = tuple(allowed_types)
        self._stores: dict[str, Store] = {}
        # store root -> the cut this plugin's fit stands on: the one it last saved or labelled, or the one
        # a resume loaded. Kept past teardown: a trainer.save_checkpoint after fit still stands there.
        self._head: dict[str, str] = {}

    # ------------------------------------------------------------------------------------- stores
    def _writer(self, root: str, *, create: bool = True) -> Store:
        """The store at ``root``, opened for writing once per fit (``StoreNotFound`` when missing and
        not ``create``)."""
        store = self._stores.get(root)
        if store is None:
            store = self._stores[root] = Store.open(root, create=create, options=self.store_options)
        return store

    # ---------------------------------------------------------------------------------- CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("CkptStoreCheckpointIO takes no per-call storage_options: pass "
                            "store_options=ckptstore.StoreOptions(...) to the plugin")
        root, name = split_path(path)
        store = self._writer(root)
        step = int(checkpoint.get("global_step", 0))
        latest = store.latest()
        if latest is not None and step <= latest.step and self._head.get(root) != latest.id:
            latest = self._rewind(store, root, latest, step, name)
        if latest is not None and step == latest.step:
            cut = latest.id  # the cut this fit stands on, at this step: one more name, never written twice
        else:
            cut = store.save(checkpoint, step=step, tags=(TAG,), metadata={"lightning": {"path": name}}).id
        self._head[root] = cut
        previous = store.labels().get(name)
        store.label(name, cut)
        if previous is not None and previous != cut:
            self._drop_if_unnamed(store, previous)

    def _rewind(self, store: Store, root: str, latest: CutInfo, step: int, name: str) -> CutInfo:
        """A save at or below LATEST's step by a fit that does not stand on LATEST's cut: it resumed from
        an older cut, so LATEST goes back to that cut and the fit's cuts continue from there (issue 19
        item 1: at LATEST's step too, where labelling LATEST named another fit's weights). A fit that
        stands on no cut of this store at or below ``step`` would step backwards: refused."""
        head = self._head.get(root)
        info = next((c for c in store.cuts() if c.id == head), None)
        if info is None or info.step > step:
            raise StepConflict(
                f"Lightning saves step {step} at or below LATEST's step {latest.step} (a cut this fit did not "
                "write) without having resumed from a checkpoint of this store at or below that step",
                store=store.url, cut=latest.id, path=name,
                hint="resume with trainer.fit(ckpt_path=...) from a checkpoint of this directory, "
                     "or give this fit a ModelCheckpoint dirpath of its own")
        log.info("ckptstore: %s continues from %s (step %d): LATEST moves back to it", store.url, info.id, info.step)
        return spi.point_latest(store, info.id)

    def _drop_if_unnamed(self, store: Store, cut: str) -> None:
        """Removes ``cut`` once no label names it (unless it is LATEST's or otherwise kept by the store)."""
        if cut in store.labels().values():
            return
        latest = store.latest()
        if latest is not None and latest.id == cut:
            return
        try:
            store.remove(cut)
        except CkptStoreError as exc:
            log.warning("ckptstore: kept unnamed cut %s of %s: %s", cut, store.url, exc)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only: nothing is ever unpickled here; the dict comes back from typed JSON and arrays.
        root, name = split_path(path)
        store = self._stores.get(root)
        whole = store is None and _is_store(os.fspath(path), self.store_options or StoreOptions())
        if whole:  # the store directory itself: its LATEST cut
            root = _store_root(path)
            store = self._stores.get(root)
        own = store is None
        if store is None:
            store = Store.open(root, readonly=True, options=self.store_options)
        try:
            cut = _latest_id(store) if whole else _resolve(store, name, root)
            state = _load(store, cut, map_location, self.allowed_types)
        finally:
            if own:
                store.close()
        self._head[root] = cut  # the fit resumes from this cut: its next saves continue from it
        return state

    def remove_checkpoint(self, path: Any) -> None:
        root, name = split_path(path)
        try:
            store = self._writer(root, create=False)
        except StoreNotFound:
            return  # nothing was ever saved there: no store to create just to find the name missing
        cut = store.unlabel(name)
        if cut is not None:
            self._drop_if_unnamed(store, cut)

    def teardown(self) -> None:
        stores, self._stores = self._stores, {}
        for store in stores.values():
            store.close()


__all__ = ["CkptStoreCheckpointIO", "load_checkpoint", "split_path", "TAG"]
