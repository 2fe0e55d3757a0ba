"""Resumable training checkpoints stored as *data*: safetensors, weights-only tensors and JSON.

A checkpoint is the directory ``<output>/checkpoints/checkpoint-N`` (``N``: optimizer steps
taken, the Hugging Face Trainer's naming)::

    model.safetensors           # the (unwrapped) module's state dict
    optimizer.pt                # optimizer state dict: tensors and numbers only, read with weights_only=True
    scheduler.json              # learning-rate scheduler state
    scaler.json                 # fp16 gradient scaler state (CUDA fp16 only)
    rng_state_<rank>.safetensors  # torch / CUDA / NumPy / Python RNG states of every process
    trainer_state.json          # step, epoch, data position, log window and a manifest (size, sha256)
                                # of every other file; written last

Nothing is ever unpickled: a run directory is treated as data, not code (a crafted pickle
left in it is never executed, whatever its name). Resuming verifies every file against the
manifest first, so a truncated or corrupt file is refused with an error naming it and
pointing to the newest earlier checkpoint that is intact. A checkpoint is written into
``.tmp-checkpoint-N`` and renamed into place when complete, so a crash while writing leaves
the previous checkpoints untouched and the partial one clearly unbuilt (and removed by the
next run). Directories named ``step-N`` (earlier versions, accelerate's pickle-based
``save_state``) are recognised but refused with an explanation.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
from typing import Any, Optional

import numpy as np
import torch

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.json"
SCALER_FILE = "scaler.json"
#: Version of the checkpoint layout recorded in ``trainer_state.json``.
CHECKPOINT_FORMAT = 2
_CKPT_RE = re.compile(r"^(checkpoint|step)-(\d+)$")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from (missing, truncated, corrupt or of an unsafe format)."""


def rng_file(rank: int) -> str:
    """Name of the RNG-state file of process ``rank``."""
    return f"rng_state_{rank}.safetensors"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def list_checkpoints(output: str) -> list[tuple[int, str]]:
    """Checkpoints under ``<output>/checkpoints`` as ``(step, path)``, oldest first.

    Lists every ``checkpoint-N`` (and legacy ``step-N``) directory holding a ``trainer_state.json``;
    whether its files are intact is checked by :func:`verify_checkpoint`. Temporary
    ``.tmp-*`` directories of interrupted writes are never listed.
    """
    root = os.path.join(output, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found: dict[int, str] = {}
    for name in os.listdir(root):
        m = _CKPT_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, TRAINER_STATE)):
            step = int(m.group(2))
            if step not in found or m.group(1) == "checkpoint":
                found[step] = path
    return sorted(found.items())


# ----------------------------------------------------------------------------- RNG states
def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as tensors plus string metadata (for a safetensors file)."""
    version, mt, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(),
               "python": torch.tensor(mt, dtype=torch.int64),
               "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    meta = {"format": str(CHECKPOINT_FORMAT), "python_version": json.dumps(version),
            "python_gauss_next": json.dumps(gauss_next), "numpy_kind": kind, "numpy_pos": json.dumps(int(pos)),
            "numpy_has_gauss": json.dumps(int(has_gauss)), "numpy_cached_gaussian": json.dumps(float(cached))}
    return tensors, meta


def save_rng_state(path: str) -> None:
    """Write this process's RNG states to ``path`` (safetensors)."""
    from safetensors.torch import save_file
    tensors, meta = rng_state()
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
    except Exception as e:  # a full disk is a SafetensorError without an errno
        if isinstance(e, (TypeError, ValueError, AttributeError)):
            raise
        raise write_failure(path, e) from e


def load_rng_state(path: str) -> None:
    """Restore this process's RNG states from a file written by :func:`save_rng_state`.

    Raises:
        CheckpointError: naming ``path`` if it cannot be read or does not hold valid states.
    """
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        mt = tuple(int(x) for x in tensors["python"].tolist())
        python_state = (json.loads(meta["python_version"]), mt, json.loads(meta["python_gauss_next"]))
        numpy_state = (meta["numpy_kind"], tensors["numpy"].numpy().astype(np.uint32), json.loads(meta["numpy_pos"]),
                       json.loads(meta["numpy_has_gauss"]), json.loads(meta["numpy_cached_gaussian"]))
        torch_state = tensors["torch"]
        cuda_states = [tensors[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in tensors))]
        # validate everything before changing any state
        random.Random().setstate(python_state)
        np.random.RandomState().set_state(numpy_state)
        if torch_state.dtype != torch.uint8 or torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"torch RNG state of {torch_state.numel()} {torch_state.dtype} values")
    except Exception as e:  # safetensors' SafetensorError, KeyError, ValueError, ...
        raise CheckpointError(f"cannot read the RNG states in {path}: {type(e).__name__}: {e}") from e
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)


# ----------------------------------------------------------------------------- files
def file_digest(path: str, chunk: int = 1 << 22) -> str:
    """sha256 of a file (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(directory: str) -> dict[str, dict[str, Any]]:
    """``{file name: {"bytes", "sha256"}}`` of the files of ``directory`` (except ``trainer_state.json``),
    each flushed to disk."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == TRAINER_STATE or not os.path.isfile(path):
            continue
        _fsync(path)
        out[name] = {"bytes": os.path.getsize(path), "sha256": file_digest(path)}
    return out


def write_failure(path: str, e: BaseException) -> OSError:
    """An ``OSError`` naming ``path`` for a failed write: torch's and safetensors' writers report a full disk as
    ``RuntimeError: basic_ios::clear`` / ``PytorchStreamWriter failed writing file`` or a ``SafetensorError``
    without an errno; the free space of the file's filesystem tells a full disk from another failure."""
    if isinstance(e, OSError) and e.errno is not None:
        return OSError(e.errno, f"cannot write {path}: {os.strerror(e.errno)}")
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
        full = st.f_bavail * st.f_frsize < (1 << 20) or "No space" in str(e) or "StorageFull" in str(e)
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, f"cannot write {path}: no space left on device")
    return OSError(errno.EIO, f"cannot write {path}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def save_train_state(directory: str, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                     scaler: Any = None) -> None:
    """Write the model, optimizer, scheduler (and scaler) files of a checkpoint (main process).

    Raises:
        OSError: naming the file that could not be written (a full disk: ``ENOSPC``), whatever library wrote it.
    """
    from safetensors.torch import save_model
    path = os.path.join(directory, MODEL_FILE)
    try:
        save_model(model, path)
        path = os.path.join(directory, OPTIMIZER_FILE)
        torch.save(optimizer.state_dict(), path)
        path = os.path.join(directory, SCHEDULER_FILE)
        with open(path, "w") as f:
            json.dump(scheduler.state_dict(), f)
        if scaler is not None:
            path = os.path.join(directory, SCALER_FILE)
            with open(path, "w") as f:
                json.dump(scaler.state_dict(), f)
    except Exception as e:  # torch's RuntimeError; safetensors' SafetensorError is a plain Exception
        if isinstance(e, (TypeError, ValueError, AttributeError)):
            raise  # a bug, not a failed write
        raise write_failure(path, e) from e


def write_trainer_state(directory: str, state: dict[str, Any]) -> None:
    """Write ``trainer_state.json`` (with the manifest of the other files) last, then flush the directory."""
    state = {**state, "format": CHECKPOINT_FORMAT, "files": manifest(directory)}
    path = os.path.join(directory, TRAINER_STATE)
    with open(path, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync(directory)


# ----------------------------------------------------------------------------- reading
def read_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint at ``path``.

    Raises:
        CheckpointError: naming the file if it is unreadable, not JSON, or a legacy pickle-based checkpoint.
    """
    state_path = os.path.join(path, TRAINER_STATE)
    try:
        with open(state_path) as f:
            state = json.load(f)
        if not isinstance(state, dict):
            raise ValueError(f"holds a JSON {type(state).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {state_path} ({type(e).__name__}: {e}); the file is truncated or "
                              "corrupt") from e
    if state.get("format") != CHECKPOINT_FORMAT or not isinstance(state.get("files"), dict):
        raise CheckpointError(
            f"{path} is a checkpoint of an earlier version of this toolkit (accelerate's save_state: pickled "
            "random_states_*.pkl and custom_checkpoint_*.pkl). It is not loaded because unpickling files from a run "
            "directory can execute code. Start the run again with --overwrite (or finish it with the version that "
            "wrote it)")
    return state


def verify_checkpoint(path: str) -> dict[str, Any]:
    """Check every file of the checkpoint at ``path`` against its manifest; returns its trainer state.

    Raises:
        CheckpointError: naming the first missing, truncated or corrupt file.
    """
    state = read_trainer_state(path)
    for name, want in state["files"].items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath} is missing")
        size = os.path.getsize(fpath)
        if size != want.get("bytes"):
            raise CheckpointError(f"{fpath} is truncated or corrupt: {size} bytes, {want.get('bytes')} written")
        if file_digest(fpath) != want.get("sha256"):
            raise CheckpointError(f"{fpath} is corrupt: its sha256 differs from the one recorded when it was written")
    for name in (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE):
        if name not in state["files"]:
            raise CheckpointError(f"{os.path.join(path, name)} is missing from the checkpoint's manifest")
    return state


def previous_intact(output: str, before_step: int) -> Optional[tuple[int, str]]:
    """The newest checkpoint of ``output`` older than ``before_step`` whose files all verify, if any."""
    for step, path in reversed(list_checkpoints(output)):
        if step >= before_step:
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return step, path
    return None


def _advice(output: str, step: int, path: str) -> str:
    prev = previous_intact(output, step)
    if prev is None:
        return (" No earlier checkpoint is intact: start again with --overwrite (or restore the file from a "
                "backup).")
    return (f" The previous checkpoint {prev[1]} (step {prev[0]}) is intact: move {path} out of the way (e.g. "
            f"`mv {path} {os.path.join(os.path.dirname(path), '.corrupt-' + os.path.basename(path))}`) and run "
            f"again with --resume to continue from step {prev[0]}.")


def load_checkpoint(output: str, step: int, path: str, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                    scaler: Any = None, rank: int = 0, world_size: int = 1, device: Any = "cpu") -> dict[str, Any]:
    """Verify and load the checkpoint ``(step, path)`` of the run at ``output`` into the given objects.

    Loads the model (safetensors), the optimizer (``torch.load(weights_only=True)``), the scheduler
    and scaler (JSON) and this process's RNG states (safetensors); returns the trainer state. A run
    resumed on another number of processes (``world_size``) is accepted with a warning: the ranks
    without a saved RNG state keep their seeded one, so the losses differ from an uninterrupted run.

    Raises:
        CheckpointError: naming the bad file and offering the newest earlier intact checkpoint.
    """
    from safetensors.torch import load_model

    current = ""
    try:
        state = verify_checkpoint(path)
        rng = rng_file(rank)
        saved_world = state.get("world_size")
        if saved_world != world_size:
            logger.warning("%s was written by %s process(es), resumed on %d: the RNG states are restored only for "
                           "ranks that existed, so the losses will differ from an uninterrupted run", path,
                           saved_world, world_size)
        elif rng not in state["files"]:
            raise CheckpointError(f"{os.path.join(path, rng)} is missing from the checkpoint's manifest")
        current = os.path.join(path, MODEL_FILE)
        load_model(model, current, strict=True, device=str(device))
        current = os.path.join(path, OPTIMIZER_FILE)
        optimizer.load_state_dict(torch.load(current, map_location="cpu", weights_only=True))
        current = os.path.join(path, SCHEDULER_FILE)
        with open(current) as f:
            scheduler.load_state_dict(json.load(f))
        if scaler is not None:
            current = os.path.join(path, SCALER_FILE)
            with open(current) as f:
                scaler.load_state_dict(json.load(f))
        if rng in state["files"]:
            current = os.path.join(path, rng)
            load_rng_state(current)
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume from {path}: {e}.{_advice(output, step, path)}") from e
    except Exception as e:  # pickle.UnpicklingError (a refused pickle), RuntimeError (shape mismatch), ...
        # the files match their recorded sha256: not damage, but a file that does not fit this run
        raise CheckpointError(f"cannot resume from {path}: {current} matches the checksum recorded when it was "
                              f"written but cannot be loaded into this run ({type(e).__name__}: "
                              f"{str(e).strip()[:500]}). Resume with the code and options that wrote it, or start "
                              "again with --overwrite") from e
    return state


__all__ = ["CheckpointError", "list_checkpoints", "load_checkpoint", "verify_checkpoint", "save_train_state",
           "save_rng_state", "load_rng_state", "write_trainer_state", "read_trainer_state", "previous_intact",
           "checkpoint_name", "rng_file", "write_failure"]
