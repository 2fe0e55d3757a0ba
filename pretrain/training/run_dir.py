"""A run's output directory: the checks before a run writes into it (:func:`check_run_dir`), its exclusive lock
(:func:`hold_output_lock`), its identity while the run writes (:class:`OutputPlace`) and the removal of a previous
run's files under ``--overwrite_output_dir`` (:func:`clear_run`)."""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Optional


__all__ = ["EXPORT_FILES", "RUN_CONFIG", "RUN_FORMAT", "RESUMABLE", "config_dict", "run_moved", "check_moved_run",
           "check_run_dir", "clear_run", "RunDirectoryError", "OutputPlace", "hold_output_lock"]

#: Files whose presence means an output directory holds an exported model.
EXPORT_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")
RUN_CONFIG = "run_config.json"


# ----------------------------------------------------------------------------- output dir
def config_dict(config: Any) -> dict[str, Any]:
    """The options of a run as a plain dict (a dataclass config, a RunConfig or a namespace)."""
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return config.options() if callable(getattr(config, "options", None)) else dict(vars(config))


def run_moved(record: dict[str, Any], output: str) -> Optional[str]:
    """Where the run recorded in ``output`` (its ``run_config.json``, ``record``) was
    started, when that is another directory than ``output`` (the run was moved or copied there); else ``None``.

    The record's ``output_path`` (the real path of the directory when the run last started) is compared with
    ``output``'s real path; a record without one compares its ``output`` option as resolved here.
    """
    here = os.path.realpath(output)
    where = record.get("output_path")
    if not isinstance(where, str):
        where = (record.get("config") or {}).get("output")
        if not isinstance(where, str) or os.path.realpath(where) == here:
            return None
        return where
    return None if where == here else where


def check_moved_run(record: dict[str, Any], output: str, resume: bool, what: str = "run") -> None:
    """A run found in another directory than the one it recorded (:func:`run_moved`): continued there with
    ``--resume_from_checkpoint`` (a warning says from where it was moved), refused without it, naming both places.

    Raises:
        ValueError: the run was moved and ``resume`` is false.
    """
    import logging

    moved_from = run_moved(record, output)
    if moved_from is None:
        return
    if not resume:
        raise ValueError(f"output directory {output} holds a {what} that was started in {moved_from} (the directory "
                         f"was moved or copied to {output}); pass --resume_from_checkpoint true to continue it in {output} "
                         "from its last checkpoint, or --overwrite_output_dir to start it again")
    logging.getLogger("pretrain").warning(
        "%s: this %s was started in %s and has been moved (or copied) here: continuing it here from its last "
        "checkpoint; its record now names %s", output, what, moved_from, os.path.realpath(output))


class RunDirectoryError(OSError):
    """A run's output directory was moved, removed or replaced while the run was writing into it."""


class OutputPlace:
    """The identity of a run's output directory (device and inode of the directory, through a descriptor held open),
    taken when the run starts: :meth:`problem` tells whether ``path`` still names that directory and it still holds
    the run's record (``marker``: ``run_config.json`` / ``training_args.json``).

    A run whose directory was moved (``mv``) or removed (``rm -rf``) while it ran would otherwise re-create the old
    path at its next checkpoint or export, with checkpoints and a model but no record: a directory that looks
    trained and cannot be resumed.
    """

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
        if self.fd is None:
            return None
        try:
            where = os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:
            return None
        return None if where.endswith(" (deleted)") or not os.path.isdir(where) else where

    def problem(self) -> Optional[str]:
        """``None`` while ``path`` is the run's directory and holds its record; else what happened to it."""
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self.identity:
            where = self.now_at()
            gone = f"was moved to {where}" if where else "was removed"
            other = "" if st is None else f" (and {self.path} is now another directory)"
            return f"the output directory {self.path} {gone} while the run was writing into it{other}"
        if not os.path.isfile(os.path.join(self.path, self.marker)):
            return f"the output directory {self.path} no longer holds the run's {self.marker} (it was removed)"
        return None

    def error(self, what: str, problem: str, run: str = "run") -> "RunDirectoryError":
        """The error that stops a run before it writes ``what`` into a directory that is no longer its own."""
        where = self.now_at()
        advice = (f"continue it there with the same command and --output_dir {where} --resume_from_checkpoint true"
                  if where else
                  "start it again")
        return RunDirectoryError(f"refusing to write {what}: {problem}; the {run} stops rather than re-create "
                                 f"{self.path} without its {self.marker}. To finish the {run}, {advice}")

    def check(self, what: str, run: str = "run") -> None:
        """Raises :meth:`error` when :meth:`problem` finds one."""
        problem = self.problem()
        if problem is not None:
            raise self.error(what, problem, run)


def hold_output_lock(stack: Any, output: str, what: str, option: str) -> None:
    """Takes the exclusive OS lock of a run's output directory into ``stack`` (rank 0 only).

    Keyed on the directory's real identity (:func:`pyterrier_cpdae._locking.build_lock`): the same command
    launched twice, or through a symlink or another spelling of the path, is refused at once with
    :class:`~pyterrier_cpdae._locking.ConcurrentBuildError` naming the running process (pid, host, since when).
    The OS releases it when the process ends, however it ends.  Other ranks of a ``torchrun`` job take no lock
    (rank 0 of the same job holds it for them).

    Raises:
        ConcurrentBuildError: another process is running into ``output``.
        ValueError: the lock file beside ``output`` cannot be created (naming ``option`` and the reason).
    """
    from pyterrier_cpdae._locking import build_lock, lock_path

    if int(os.environ.get("RANK", "0") or 0) != 0:
        return
    try:
        stack.enter_context(build_lock(output, what, "written"))
    except OSError as e:
        raise ValueError(f"{option} {output}: cannot create its lock file {lock_path(output)} "
                         f"({e.strerror or e})") from e


def _clear_previous_run(out: str) -> None:
    """With ``overwrite``: remove what a previous run left (checkpoints, logs, run config, and the whole exported
    model: weights, tokenizer and sentence-transformers files), so that a run cut short leaves no earlier model
    that still loads; other files in the directory are kept."""
    from pyterrier_cpdae.encoder.st_export import remove_exported_model

    for name in ("checkpoints", "logs", "decoder", "mlm_head", ".export-tmp"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    if os.path.isfile(os.path.join(out, RUN_CONFIG)):
        os.remove(os.path.join(out, RUN_CONFIG))
    remove_exported_model(out)  # config.json and the weights included


# ----------------------------------------------------------------------------- the Trainer's run directory
#: The marker of a run directory written by the Hugging Face Trainer loop (``run_config.json``'s ``format``).
RUN_FORMAT = "hf-trainer"

#: Options that may change when a run is resumed: how long it trains, how it runs, where and what it probes.
RESUMABLE = frozenset({"max_steps", "num_train_epochs", "cache_dir", "unpad", "torch_compile", "use_cpu", "cpu",
                       "probe", "probe_max_queries", "probe_max_docs", "output", "preset"})


def check_run_dir(config: Any, resume: bool, overwrite: bool, own: Any = ()) -> None:
    """Refuse an output directory the run may not write into: one of the previous format (one line saying what to
    do), one holding a different run (options differ), or a finished/checkpointed run without ``--resume_from_checkpoint``
    or ``--overwrite_output_dir``. The names in ``own`` (the run's token cache inside its directory) do not count.

    Raises:
        ValueError: naming the directory, the reason and what to do.
    """
    out = config.output
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output_dir {out} exists and is not a directory")
    if not os.path.isdir(out) or not set(os.listdir(out)) - set(own):
        return
    record_path = os.path.join(out, RUN_CONFIG)
    record = None
    if os.path.isfile(record_path):
        from pyterrier_cpdae._files import read_config_file
        record = read_config_file(record_path)
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
        shown = "; ".join(f"--{k}: {previous[k]!r} -> {current[k]!r}" for k in differ)
        raise ValueError(f"--output_dir {out} holds a different run (options differ: {shown}); choose another "
                         "--output_dir or pass --overwrite_output_dir to replace it")
    check_moved_run(record, out, resume)
    has_run = any(n.startswith("checkpoint-") for n in os.listdir(out)) or \
        any(os.path.exists(os.path.join(out, f)) for f in EXPORT_FILES)
    if has_run and not resume:
        raise ValueError(f"--output_dir {out} already holds checkpoints or an exported model of this run; pass "
                         "--resume_from_checkpoint to continue it or --overwrite_output_dir to start again")


def clear_run(out: str) -> None:
    """``--overwrite_output_dir``: remove a previous run's checkpoints, logs, record and exported model."""
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("checkpoint-") or name == "runs":
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    _clear_previous_run(out)
