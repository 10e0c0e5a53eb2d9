"""Hugging Face ``Trainer`` cuts through the Checkpointer, and exact resumes, with public API only.

Saving: :class:`CkptStoreCallback` is a ``TrainerCallback`` that owns a
:class:`~ckptstore.writer.Checkpointer`. After an optimizer step it cuts the model, optimizer,
scheduler (and, given the trainer, grad-scaler) state dicts, the RNG states in the Trainer's own
layout and the ``TrainerState`` as the JSON text the Trainer writes itself. The run's last step is cut
with ``final=True`` instead of a periodic cut, so ``ckptstore resume-info`` reports the step where the
run ended (never step + 1, issue 13).

Several processes: with ``group=torch.distributed.group.WORLD`` every rank opens the Checkpointer
collectively and cuts its own part of one cut: rank 0 the whole state as above, every other rank its
RNG states (DDP replicates the rest). Without ``group=`` only the world's process zero cuts.

Resuming: ``Trainer.train(resume_from_checkpoint=DIR)`` restores the model, optimizer, scheduler,
scaler, RNG, trainer state and the data position (from ``global_step``) from its own files.
:func:`resume_dir` writes exactly those files from a cut (``rng_state_{rank}.pth`` from each rank's
part), so no private Trainer method is overridden; :func:`train` wraps it for the usual case, on every
rank. The cut is read without unpickling (``ckptstore.load`` without ``allow_pickle``); the files are
written for the ``torch.load(weights_only=True)`` the Trainer uses. docs/integrations.md ("Hugging
Face Trainer") has the whole story, multi-process runs included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import tempfile
from typing import Any

import numpy as np
import safetensors.torch
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import TrainOutput
from transformers.training_args import ParallelMode
from transformers.utils import SAFE_WEIGHTS_NAME

from ckptstore import Store, StoreOptions
from ckptstore.errors import CutNotFound, StoreNotFound, UsageError
from ckptstore.writer import Checkpointer, CutHandle

__all__ = ["CkptStoreCallback", "resume_dir", "train", "trainer_rng", "CUT_KEYS", "RANK_PART_KEYS"]

log = logging.getLogger("ckptstore.integrations.transformers")

#: The top-level keys of a cut written by :class:`CkptStoreCallback` (plus ``scaler`` when one exists);
#: in a cut of several ranks, those of rank 0's part.
CUT_KEYS = ("step", "extra", "model", "optimizer", "scheduler", "trainer_rng", "trainer_state")
#: The top-level keys of the part of any other rank (``group=``): the state DDP does not replicate.
RANK_PART_KEYS = ("step", "extra", "trainer_rng")
#: ``extra["integration"]`` of such a cut: tells it from cuts of other loops sharing the code path.
INTEGRATION = "transformers.Trainer/1"


def trainer_rng(args: TrainingArguments) -> dict[str, Any]:
    """The RNG states in the layout ``Trainer`` saves to ``rng_state.pth`` and reads back
    (``python``, ``numpy``, ``cpu``, and ``cuda``: every device's in a distributed run, else the
    current device's), so the Trainer's own resume puts them back. Other accelerators (XLA, NPU, HPU,
    MLU, MUSA) are not captured."""
    rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
        rng["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return rng


def _trainer_state_json(state: TrainerState) -> str:
    """``TrainerState.save_to_json``'s text, byte for byte: it goes back into trainer_state.json."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


class CkptStoreCallback(TrainerCallback):
    """Cuts a ``Trainer`` run into a ckptstore store through a background :class:`Checkpointer`.

    ``every``: a periodic cut every that many optimizer steps (skipped while the previous one is still
    being written, as ``Checkpointer.maybe_cut``). ``trainer``: optional; given, the grad scaler
    (``trainer.accelerator.scaler``, fp16) is cut too. ``checkpointer_kwargs`` go to the Checkpointer
    (``keep=``, ``mode=``, ``store_options=``, ``events_path=``...).

    ``group``: None, and only the world's process zero opens the store and cuts; or a process group
    holding every process of the run in rank order (``torch.distributed.group.WORLD``, which exists
    once ``TrainingArguments`` was made), and every rank opens the Checkpointer with it and cuts its own
    part: rank 0 the whole state, the others their RNG states (:data:`RANK_PART_KEYS`). Every decision
    to cut depends only on what all ranks share (the step, ``max_steps``, the Trainer's control flags),
    so every rank makes the same collective calls at the same steps (docs/integrations.md, "Several
    processes").

    A cut due at a step the Trainer logs is taken in ``on_log``, after the Trainer drained its loss
    accumulator and appended that step's entry to ``log_history``: where the Trainer's own checkpoint
    would be taken. Otherwise it is taken in ``on_step_end``. Model, optimizer, scheduler and RNG do not
    change between the two.
    """

    def __init__(self, url_or_store: str | Store, *, every: int = 1, trainer: Trainer | None = None,
                 group: Any = None, **checkpointer_kwargs: Any) -> None:
        if checkpointer_kwargs.get("preemption"):
            raise UsageError("CkptStoreCallback does not support preemption=True yet: the Trainer has no public "
                             "way to stop at the signal's step", hint="use a periodic every= instead")
        if every < 1:
            raise UsageError(f"every must be >= 1, got {every}")
        self.url_or_store = url_or_store
        self.every = every
        self.trainer = trainer
        self.group = group
        self._kwargs = checkpointer_kwargs
        #: The Checkpointer, from ``on_train_begin`` (process zero only, or every rank of ``group``)
        #: until ``on_train_end``.
        self.checkpointer: Checkpointer | None = None
        #: This process's rank in ``group`` (0 without one): rank 0 cuts the whole state, the others their RNG.
        self.rank = 0
        #: The handle of the last cut handed to the Checkpointer (None before the first).
        self.last_handle: CutHandle | None = None
        self._pending: tuple[TrainingArguments, int, bool] | None = None  # (args, step, final) awaiting on_log
        self._final_taken = False

    # ------------------------------------------------------------------------------- Trainer events
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.checkpointer is not None:
            return
        if self.group is None:
            if not state.is_world_process_zero:
                return
            if args.world_size > 1:
                log.warning("ckptstore: %d processes and no group=: only process zero cuts, so the other ranks' RNG "
                            "states are not saved (pass group=torch.distributed.group.WORLD)", args.world_size)
            self.checkpointer = Checkpointer(self.url_or_store, every=self.every, **self._kwargs)
            self.rank = 0
        else:
            _check_group(self.group, args, str(self.url_or_store))
            # Collective: every rank opens, rank 0 as the store's writer, the others as participants.
            self.checkpointer = Checkpointer(self.url_or_store, every=self.every, group=self.group, **self._kwargs)
            ranks = self.checkpointer.store.ranks
            self.rank = ranks.rank if ranks is not None else 0
        self._final_taken = False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        step = state.global_step
        # Invariant (group=): this decision, and should_log's below, read only what every rank shares, so
        # every rank calls cut or maybe_cut (collective) at the same step; the Trainer itself needs
        # should_training_stop to agree across ranks, or its next step's all-reduce would hang.
        final = step >= state.max_steps or control.should_training_stop
        if not final and step % self.every != 0:
            return
        # DefaultFlowCallback (always first in the list) has decided by now whether this step logs.
        if control.should_log:
            self._pending = (args, step, final)
            return
        self._take(args, state, final, kwargs)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self._pending is not None and self._pending[1] == state.global_step:
            _, _, final = self._pending
            self._pending = None
            self._take(args, state, final, kwargs)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._flush(state, kwargs)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._flush(state, kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.checkpointer is None:
            return
        self._flush(state, kwargs)
        last = self.last_handle.step if self.last_handle is not None else -1
        if not self._final_taken and state.global_step > last:
            # The run ended (on_train_end comes only then) past its last cut, e.g. a callback stopped it
            # after on_step_end: that state is the final one.
            self._take(args, state, True, kwargs)
        ck, self.checkpointer = self.checkpointer, None
        ck.close()

    # ------------------------------------------------------------------------------------- internals
    def _flush(self, state: TrainerState, kwargs: dict[str, Any]) -> None:
        """A cut deferred to ``on_log`` whose log never came: take it now (nothing it holds changed but
        ``log_history``)."""
        if self._pending is not None and self.checkpointer is not None:
            args, _, final = self._pending
            self._pending = None
            self._take(args, state, final, kwargs)

    def _take(self, args: TrainingArguments, state: TrainerState, final: bool, kwargs: dict[str, Any]) -> None:
        ck = self.checkpointer
        assert ck is not None
        cut_state = self.cut_state(args, state, kwargs)
        if final:
            # Invariant: the last step is never a periodic cut too, so the final cut needs no step + 1.
            handle: CutHandle | None = ck.cut(state.global_step, cut_state, final=True)
            self._final_taken = True
        else:
            handle = ck.maybe_cut(state.global_step, cut_state)
        if handle is not None:
            self.last_handle = handle

    def cut_state(self, args: TrainingArguments, state: TrainerState, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The state this rank's part of a cut holds (keys :data:`CUT_KEYS` on rank 0,
        :data:`RANK_PART_KEYS` on the others); tensors are copied by the Checkpointer."""
        extra = {"integration": INTEGRATION, "world_size": args.world_size}
        if self.rank != 0:
            # DDP keeps model, optimizer, scheduler and TrainerState equal on every rank: rank 0's part
            # holds them once. The RNG states are each rank's own (rng_state_{rank}.pth).
            return {"step": state.global_step, "extra": extra, "trainer_rng": trainer_rng(args)}
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None or optimizer is None or scheduler is None:
            raise UsageError(f"step {state.global_step}: the Trainer passed no model/optimizer/lr_scheduler to the "
                             "callback; cut_state needs all three", store=str(self.url_or_store))
        out: dict[str, Any] = {
            "step": state.global_step,
            "extra": extra,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "trainer_rng": trainer_rng(args),
            "trainer_state": _trainer_state_json(state),
        }
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
        return out


def _check_group(group: Any, args: TrainingArguments, store: str) -> None:
    """``group`` must be every process of the run in rank order: a rank's part then holds the RNG of the
    process the Trainer names ``rng_state_{process_index}.pth``. Every rank checks the same facts, so
    every rank raises (before any collective call) or none does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("group= needs torch.distributed to be initialized", store=store,
                         hint="TrainingArguments initializes it in a run of several processes (torchrun)")
    members = list(dist.get_process_group_ranks(group))
    if members != list(range(args.world_size)):
        raise UsageError(f"group= must hold every process of the run in rank order (0 to {args.world_size - 1}); "
                         f"it holds {members}", store=store, hint="pass torch.distributed.group.WORLD")


def resume_dir(url: str | Store, cut: str | int = "latest", dir: str | None = None, *, rank: int | None = None,
               store_options: StoreOptions | None = None) -> str | None:
    """Writes a cut of :class:`CkptStoreCallback` as a Trainer checkpoint directory and returns its
    path, for ``trainer.train(resume_from_checkpoint=...)``; None when the store is missing or has no
    cut. ``dir`` must be missing or empty (default: a new temporary directory; the caller removes it
    after ``train`` returned: the Trainer reads ``rng_state.pth`` only at its first step). The cut is
    verified while read and never unpickled.

    A cut of several ranks (``group=``): the shared files come from rank 0's part and
    ``rng_state_{r}.pth`` from rank r's; ``rank`` (the Trainer's ``args.process_index``) writes only
    that rank's RNG file, None every rank's (the directory the Trainer itself would write). A rank the
    cut does not hold gets no RNG file; the Trainer then says so and goes on, as with its own
    checkpoints of another world size."""
    if dir is not None and os.path.isdir(dir) and os.listdir(dir):
        raise UsageError(f"resume_dir needs a missing or empty directory; {dir} holds {sorted(os.listdir(dir))[:5]}",
                         path=dir, hint="stale weights or optimizer files there would be read by the Trainer")
    loaded = _load_cut(url, cut, store_options, rank)
    if loaded is None:
        return None
    state, rng_files = loaded
    dir = tempfile.mkdtemp(prefix="ckptstore-hf-") if dir is None else dir
    os.makedirs(dir, exist_ok=True)
    safetensors.torch.save_file(_unshared(state["model"]), os.path.join(dir, SAFE_WEIGHTS_NAME),
                                metadata={"format": "pt"})
    torch.save(state["optimizer"], os.path.join(dir, OPTIMIZER_NAME))
    torch.save(state["scheduler"], os.path.join(dir, SCHEDULER_NAME))
    if "scaler" in state:
        torch.save(state["scaler"], os.path.join(dir, SCALER_NAME))
    for name, rng in rng_files.items():
        torch.save(rng, os.path.join(dir, name))
    with open(os.path.join(dir, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(state["trainer_state"])
    return dir


def train(trainer: Trainer, url: str | Store, *, cut: str | int = "latest",
          store_options: StoreOptions | None = None, **train_kwargs: Any) -> TrainOutput:
    """``trainer.train()``, resuming from ``cut`` of the store when it has one (through a temporary
    :func:`resume_dir` of this process's rank, removed when ``train`` returns). Call it on every rank."""
    rank = trainer.args.process_index if trainer.args.world_size > 1 else None
    with tempfile.TemporaryDirectory(prefix="ckptstore-hf-") as tmp:
        ckpt = resume_dir(url, cut, os.path.join(tmp, "checkpoint"), rank=rank, store_options=store_options)
        return trainer.train(resume_from_checkpoint=ckpt, **train_kwargs)


def _load_cut(url: str | Store, cut: str | int, store_options: StoreOptions | None,
              rank: int | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(rank 0's part of the cut, {RNG file name: RNG states}), the cut checked to come from
    :class:`CkptStoreCallback`; None for no store or no cut."""
    try:
        store = url if isinstance(url, Store) else Store.open(url, readonly=True, options=store_options)
    except StoreNotFound:
        return None
    try:
        if cut == "latest" and store.latest() is None:
            return None
        m = store.manifest(cut)
        world = m.world_size
        # Verified while read; refuses pickled cuts.
        state = store.load(m.cut, map_location="cpu", rank=0 if world > 1 else None)
        _check_part(state, CUT_KEYS, store.url, m.cut)
        if world == 1:
            # One process cut (group=None): rng_state.pth, or rng_state_0.pth in a world of several.
            name = "rng_state.pth" if int(state["extra"].get("world_size", 1)) <= 1 else "rng_state_0.pth"
            return state, {name: state["trainer_rng"]}
        if rank is None:
            ranks = list(range(world))
        elif 0 <= rank < world:
            ranks = [rank]
        else:
            log.warning("ckptstore: cut %s of %s holds ranks 0 to %d; rank %d gets no RNG file", m.cut, store.url,
                        world - 1, rank)
            ranks = []
        rngs = {}
        for r in ranks:
            part = state if r == 0 else store.load(m.cut, map_location="cpu", rank=r)
            if r != 0:
                _check_part(part, RANK_PART_KEYS, store.url, m.cut)
            rngs[f"rng_state_{r}.pth"] = part["trainer_rng"]
        return state, rngs
    finally:
        if store is not url:
            store.close()


def _check_part(state: Any, keys: tuple[str, ...], url: str, cut: str) -> None:
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing or not isinstance(state["extra"], dict) or state["extra"].get("integration") != INTEGRATION:
        raise CutNotFound(f"cut {cut} was not written by CkptStoreCallback (missing {missing or 'its marker'})",
                          store=url, cut=cut, hint="resume it with ckptstore.restore instead")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): give each key its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
