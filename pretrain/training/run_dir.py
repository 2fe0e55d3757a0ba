"""A run's output directory: the checks before a run writes into it (:func:`check_run_dir`), its exclusive lock
(:func:`hold_output_lock`), its identity while the run writes (:class:`OutputPlace`) and the removal of a previous
run's files under ``--overwrite_output_dir`` (:func:`clear_run`)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Any, Optional

from pyterrier_cpdae._files import read_config_file
from pyterrier_cpdae._locking import build_lock, lock_path

#: Files whose presence means an output directory holds an exported model.
EXPORT_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")
RUN_CONFIG = "run_config.json"
#: The marker of a run directory written by the Hugging Face Trainer loop (``run_config.json``'s ``format``).
RUN_FORMAT = "hf-trainer"
#: Options that may change when a run is resumed: how it runs, where and what it probes, and how long it trains (a
#: new length only where the steps taken ran at its schedule's rates: ``PretrainTrainer``'s resume check).
RESUMABLE = frozenset({"max_steps", "num_train_epochs", "cache_dir", "unpad", "torch_compile", "gradient_checkpointing",
                       "use_cpu", "cpu", "per_device_train_batch_size", "probe", "probe_max_queries", "probe_max_docs",
                       "output", "preset"})


class RunDirectoryError(OSError):
    """A run's output directory was moved, removed or replaced while the run was writing into it."""


class OutputPlace:
    """The identity (device, inode) of a run's output directory, taken when the run starts, with a descriptor held
    open: :meth:`problem` tells whether ``path`` still names that directory and it still holds ``marker`` (the run's
    record). A run whose directory was moved or removed would otherwise re-create the old path at its next write,
    with checkpoints but no record: a directory that looks trained and cannot be resumed."""

    def __init__(self, path: str, marker: str):
        self.path, self.marker = path, marker
        try:
            self.fd: Optional[int] = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # a system that cannot open a directory (Windows): the identity alone
            self.fd = None
        st = os.fstat(self.fd) if self.fd is not None else os.stat(path)
        self.identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def now_at(self) -> Optional[str]:
        """Where the directory is now (Linux: through the descriptor held open), if it still exists."""
        with contextlib.suppress(OSError):
            where = os.readlink(f"/proc/self/fd/{self.fd}") if self.fd is not None else ""
            return where if where and not where.endswith(" (deleted)") and os.path.isdir(where) else None
        return None

    def problem(self) -> Optional[str]:
        """``None`` while ``path`` is the run's directory and holds its record; else what happened to it."""
        st = None
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
        if st is None or (st.st_dev, st.st_ino) != self.identity:
            where = self.now_at()
            other = "" if st is None else f" (and {self.path} is now another directory)"
            return (f"the output directory {self.path} {f'was moved to {where}' if where else 'was removed'} while "
                    f"the run was writing into it{other}")
        if not os.path.isfile(os.path.join(self.path, self.marker)):
            return f"the output directory {self.path} no longer holds the run's {self.marker} (it was removed)"
        return None

    def error(self, what: str, problem: str) -> RunDirectoryError:
        """The error that stops a run before it writes ``what`` into a directory that is no longer its own."""
        where = self.now_at()
        advice = (f"continue it there with the same command and --output_dir {where} --resume_from_checkpoint true"
                  if where else "start it again")
        return RunDirectoryError(f"refusing to write {what}: {problem}; the run stops rather than re-create "
                                 f"{self.path} without its {self.marker}. To finish the run, {advice}")


def hold_output_lock(stack: Any, output: str) -> None:
    """The exclusive OS lock of ``output`` (:func:`pyterrier_cpdae._locking.build_lock`, keyed on its real identity)
    taken into ``stack`` on rank 0 (the other ranks run under it): ConcurrentBuildError while another process writes
    into ``output``, ValueError when the lock file cannot be created."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        try:
            stack.enter_context(build_lock(output, "output directory of a pre-training run", "written"))
        except OSError as e:
            raise ValueError(f"--output_dir {output}: cannot create its lock file {lock_path(output)} "
                             f"({e.strerror or e})") from e


def check_run_dir(config: Any, resume: bool, overwrite: bool, own: Any = ()) -> None:
    """Refuse an output directory the run may not write into: one of the previous format, one holding a different
    run (a resume with changed options: they set its schedule and what it learns), a checkpointed run without
    ``--resume_from_checkpoint`` or ``--overwrite_output_dir``, a run moved from elsewhere without a resume
    (ValueError: one line naming the directory, the reason and what to do). The names in ``own`` (the run's token
    cache inside its directory) do not count."""
    out = config.output
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output_dir {out} exists and is not a directory")
    if not os.path.isdir(out) or not set(os.listdir(out)) - set(own):
        return
    record = None
    if os.path.isfile(os.path.join(out, RUN_CONFIG)):
        record = read_config_file(os.path.join(out, RUN_CONFIG))
    if os.path.isdir(os.path.join(out, "checkpoints")) or (record is not None and record.get("format") != RUN_FORMAT):
        if not overwrite or resume:
            raise ValueError(f"--output_dir {out} holds a run of the previous format (checkpoints/checkpoint-N, its "
                             "own options): it cannot be resumed on the Hugging Face Trainer; its exported model still "
                             "loads: start the run again with --overwrite_output_dir or choose another --output_dir")
        return
    if overwrite:
        return
    if record is None:
        entries = sorted(set(os.listdir(out)) - set(own))
        raise ValueError(f"--output_dir {out} is not empty and holds no {RUN_CONFIG} (it contains "
                         f"{', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}); choose another "
                         "--output_dir or pass --overwrite_output_dir")
    previous, current = record.get("config", {}), config.options()
    differ = sorted(k for k in set(previous) & set(current) - RESUMABLE if previous[k] != current[k])
    if differ:
        shown = "; ".join(f"--{'global_batch_size' if k == 'batch_size' else k}: {previous[k]!r} -> {current[k]!r}"
                          for k in differ)
        if resume:
            raise ValueError(f"--resume_from_checkpoint refused: the run in {out} was started with other options "
                             f"({shown}), which set its schedule and what it learns; resume with the options it was "
                             "started with, or start a new run (another --output_dir, or --overwrite_output_dir)")
        raise ValueError(f"--output_dir {out} holds a different run (options differ: {shown}); choose another "
                         "--output_dir or pass --overwrite_output_dir to replace it")
    here, where = os.path.realpath(out), record.get("output_path")  # where it last started (else its --output_dir)
    if not isinstance(where, str):
        where = (record.get("config") or {}).get("output")
        where = where if isinstance(where, str) and os.path.realpath(where) != here else here
    if where != here and not resume:
        raise ValueError(f"--output_dir {out} holds a run that was started in {where} (the directory was moved or "
                         f"copied); pass --resume_from_checkpoint true to continue it here from its last checkpoint, "
                         "or --overwrite_output_dir to start it again")
    if where != here:
        logging.getLogger("pretrain").warning("%s: this run was started in %s and has been moved (or copied) here: "
                                              "continuing it here from its last checkpoint", out, where)
    if not resume and (any(n.startswith("checkpoint-") for n in os.listdir(out)) or
                       any(os.path.exists(os.path.join(out, f)) for f in EXPORT_FILES)):
        raise ValueError(f"--output_dir {out} already holds checkpoints or an exported model of this run; pass "
                         "--resume_from_checkpoint to continue it or --overwrite_output_dir to start again")


def clear_run(out: str) -> None:
    """``--overwrite_output_dir``: remove what a previous run left in ``out`` (its checkpoints, logs, record and whole
    exported model: weights, tokenizer, sentence-transformers files), so that a run cut short leaves no earlier model
    that still loads; other files are kept."""
    from pyterrier_cpdae.encoder.st_export import remove_exported_model

    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("checkpoint-") or name in ("runs", "checkpoints", "logs", "decoder", "mlm_head",
                                                      ".export-tmp"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    if os.path.isfile(os.path.join(out, RUN_CONFIG)):
        os.remove(os.path.join(out, RUN_CONFIG))
    remove_exported_model(out)  # config.json and the weights included
