"""Stages of the paper pipeline: pre-training (base, continuations), BM25 negatives, fine-tuning.

Every training stage is one ``python -m pretrain ...`` command (run as a subprocess, the path a user
takes; the smoke scale may run it in-process, ``"runner": "inprocess"``, to save the interpreter
start-ups: same argument parsing and code). A stage is *done* when its output directory holds
what ``python -m pretrain`` writes at the end of a run (the exported ``config.json`` beside a
``run_config.json`` for pre-training; ``reproduction.json`` with ``finished: true`` for fine-tuning)
**and** the recorded options equal the stage's command (compared by ``pretrain``'s own parser and
:data:`pretrain.training.run_dir.RESUMABLE`, the check ``--resume_from_checkpoint`` itself makes). A stage directory
holding the same run unfinished is resumed with ``--resume``; one holding a different run is refused.
Each finished stage's command, wall time and (pre-training) encoder sequences are recorded in
``<work>/stages/<stage>.json``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .config import ROOT

#: A stage directory written to less than this many seconds ago, unfinished, is taken to be running.
RUNNING_WINDOW_S = 600
#: Options of a pre-training run that may differ between the recorded run and the stage's command (they do
#: not change what is trained). Stricter than ``--resume``'s own list: a run with other steps is another run.
#: Options that may differ on a resume (pretrain.training.run_dir.RESUMABLE) but decide when a run is
#: finished: a finished run with other values is never taken as done; it is resumed to the new length.
LENGTH_OPTIONS = ("max_steps", "epochs", "num_train_epochs", "mining_rounds")


def adopted_wall(output: Path, end: Path) -> Optional[float]:
    """Seconds from the earliest-written file under ``output`` to ``end`` (its last file): a stage's wall time told
    by its files; None where the files cannot tell it (no earlier file, or clocks that put ``end`` first)."""
    times = [p.stat().st_mtime for p in output.rglob("*") if p.is_file() and p != end]
    wall = end.stat().st_mtime - min(times) if times else None
    return wall if wall is not None and wall >= 0 else None


class StageError(RuntimeError):
    """A stage failed, conflicts with what its directory holds, or is being run by another process (the message
    names the stage; ``python -m experiments.paper`` prints it without a traceback and exits 1)."""


def to_argv(args: dict[str, Any], trainer: bool = False) -> list[str]:
    """``{"max_steps": 4, "new_mlm_head": True}`` -> ``["--max-steps", "4", "--new-mlm-head"]`` (order kept);
    ``trainer``: the Hugging Face Trainer's spelling (``--max_steps 4 --new_mlm_head``, a false flag as ``--x false``)."""
    argv: list[str] = []
    for k, v in args.items():
        if v is None:
            continue
        flag = "--" + (k if trainer else k.replace("_", "-"))
        if v is True:
            argv.append(flag)
        elif v is False:
            argv += [flag, "false"] if trainer else ["--no-" + k.replace("_", "-")]
        else:
            argv += [flag, str(v)]
    return argv


@dataclasses.dataclass
class Stage:
    """One ``python -m pretrain`` command with its output directory."""

    name: str                      # e.g. "base", "continue:cpdae", "finetune:marco:cpdae"
    kind: str                      # "pretrain" or "finetune"
    argv: list[str]                # arguments after ``python -m pretrain``
    output: Path
    sequences_per_step: int = 0    # encoder sequences per optimizer step (pre-training)
    needs: list[str] = dataclasses.field(default_factory=list)  # stage names whose outputs this one reads

    @property
    def command(self) -> str:
        return "python -m pretrain " + " ".join(shlex.quote(a) for a in self.argv)

    # ------------------------------------------------------------------ state
    def _parsed(self) -> Any:
        if self.kind == "finetune":
            from pretrain.finetune.train import recorded_options
            return recorded_options(self.argv[1:])
        from pretrain.arguments import parse_args, run_config
        return run_config(*parse_args(self.argv))

    def _recorded(self) -> Optional[dict[str, Any]]:
        f = self.output / ("reproduction.json" if self.kind == "finetune" else "run_config.json")
        if not f.exists():
            return None
        from pyterrier_cpdae._files import read_config_file
        return read_config_file(f)  # one line naming the file if it is not a readable record

    def _compare(self, rec: Optional[dict[str, Any]]) -> tuple[list[str], bool]:
        """(options that make the recorded run another run, whether it was asked for another length: steps,
        epochs, mining rounds), with the command parsed once."""
        if rec is None:
            return [], False
        if self.kind == "finetune":
            from pretrain.finetune.arguments import RESUME_MUTABLE
            previous, current = rec.get("options", {}), self._parsed()
            other_length = any(previous.get(k) != current.get(k) for k in LENGTH_OPTIONS if k in previous or k in current)
            return sorted(k for k in set(previous) | set(current)
                          if k not in RESUME_MUTABLE and previous.get(k) != current.get(k)), other_length
        from pretrain.training.run_dir import RESUMABLE
        previous, current = rec.get("config", {}), self._parsed().options()
        conflicts = sorted(k for k in set(previous) & set(current) - RESUMABLE if previous[k] != current[k])
        other_length = any(k in previous and k in current and previous[k] != current[k] for k in LENGTH_OPTIONS)
        return conflicts, other_length

    def differences(self) -> list[str]:
        """Options whose recorded value differs from this stage's command (empty if nothing is recorded)."""
        return self._compare(self._recorded())[0]

    def input_changes(self, rec: Optional[dict[str, Any]] = None) -> list[str]:
        """What the run in the stage directory was made from and no longer is, one phrase per change: its data files
        (the fingerprints ``python -m pretrain`` recorded: the corpus of a pre-training, the training data and
        negatives of a fine-tuning) and the weights of the model it started from (its model card's
        ``base_model.weights_sha256``). Empty when nothing changed or nothing was recorded."""
        from pretrain.export.record import weights_sha256
        from pretrain.data.inputs import corpus_fingerprints, input_changes, training_inputs
        rec = self._recorded() if rec is None else rec
        if rec is None:
            return []
        if self.kind == "finetune":  # digests of --train's files, a --negatives file or model, --model's weights
            from pretrain.finetune.arguments import parse_args
            from pretrain.finetune.train import input_digests
            try:
                now = input_digests(parse_args(self.argv[1:])[0])
            except (OSError, ValueError) as e:
                return [f"its data cannot be read any more ({type(e).__name__}: {e})"]
            have = rec.get("inputs") or {}
            return [f"its {k} ({'--' + k}) changed" for k in sorted(now) if k in have and have[k] != now[k]]
        previous, changes = rec.get("inputs") or {}, []
        try:
            if self.kind == "finetune" and previous.get("specs"):
                changes += input_changes(previous, training_inputs(*map(_anchored, previous["specs"])))
            elif self.kind == "pretrain" and previous.get("corpus"):
                changes += input_changes({"corpus_files": previous.get("corpus_files") or {}},
                                         {"corpus_files": corpus_fingerprints(_anchored(previous["corpus"]))})
        except (OSError, ValueError) as e:
            changes.append(f"its data cannot be read any more ({type(e).__name__}: {e})")
        try:
            card = json.loads((self.output / "model_card.json").read_text())
        except (OSError, ValueError):
            card = {}
        base = (card.get("record") or {}).get("base_model") or {}
        if base.get("weights_sha256") and base.get("name"):
            now = weights_sha256(str(base["name"]))
            if now != base["weights_sha256"]:
                changes.append(f"the model it started from, {base['name']}, "
                               + (f"has other weights now (SHA-256 {base['weights_sha256'][:12]}... -> {now[:12]}...)"
                                  if now else "has no weights file any more"))
        return changes

    def _done(self, rec: dict[str, Any]) -> bool:
        """The record says the run finished (what ``python -m pretrain`` writes last)."""
        return bool(rec.get("finished")) if self.kind == "finetune" else (self.output / "config.json").exists()

    def finished(self) -> bool:
        """The directory holds a finished run of this stage's command, made from the inputs as they are now."""
        rec = self._recorded()
        if rec is None or not self._done(rec):
            return False
        conflicts, other_length = self._compare(rec)
        return not conflicts and not other_length and not self.input_changes(rec)

    def last_write(self) -> float:
        """Seconds since anything in the stage directory (two levels deep) was last written."""
        newest = 0.0
        for root, dirs, files in os.walk(self.output):
            depth = Path(root).relative_to(self.output).parts
            if len(depth) > 2:
                continue
            for n in files + dirs:
                try:
                    newest = max(newest, os.stat(os.path.join(root, n)).st_mtime)
                except OSError:
                    pass
        return time.time() - newest if newest else float("inf")

    def state(self) -> str:
        """``done``, ``todo`` (nothing there), ``resume`` (same run, unfinished), ``running`` (same run, written
        to within :data:`RUNNING_WINDOW_S`) or ``conflict: ...`` (a different run)."""
        if not self.output.exists() or not any(self.output.iterdir()):
            return "todo"
        rec = self._recorded()  # read and compared once (finished() would read and compare it again)
        if rec is None:
            return f"conflict: {self.output} is not empty and holds no record of a python -m pretrain run"
        diff, other_length = self._compare(rec)
        if diff:
            return f"conflict: {self.output} holds a different run (options differ: {', '.join(diff)})"
        changed = self.input_changes(rec)
        if changed:
            return f"conflict: {self.output} holds a run made from inputs that changed since ({'; '.join(changed)})"
        if self._done(rec) and not other_length:  # finished(): no conflict and no change, checked above
            return "done"
        owner = self.owner()
        if owner is not None:  # started by this pipeline: running exactly while its process lives
            return "running" if _alive(owner) else "resume"
        return "running" if self.last_write() < RUNNING_WINDOW_S else "resume"

    @property
    def pid_file(self) -> Path:
        return self.output.parent / f"{self.output.name}.pid"

    def owner(self) -> Optional[int]:
        """The process id of the pipeline process running this stage (its ``<output>.pid``), if any."""
        try:
            return int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def sequences(self) -> Optional[int]:
        """Encoder sequences seen (optimizer steps x batch x sequences per text) of a finished pre-training."""
        rec = self._recorded()
        if self.kind != "pretrain" or rec is None:
            return None
        steps = rec.get("trainer", {}).get("total_steps")
        return None if steps is None else int(steps) * int(rec["config"]["batch_size"]) * self.sequences_per_step


def _anchored(spec: str) -> str:
    """``spec`` with a relative local path made absolute from the repository root (the stages run there)."""
    kind, sep, rest = spec.partition(":")
    if sep:  # kind:path (irds: ids and absolute paths as they are)
        if kind != "irds" and rest and not os.path.isabs(rest) and not rest.startswith("~"):
            return f"{kind}:{ROOT / rest}"
        return spec
    return str(ROOT / spec) if not os.path.isabs(spec) and (ROOT / spec).exists() else spec  # a bare path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Runner:
    """Runs stages (subprocess or in-process), records them under ``<work>/stages``."""

    def __init__(self, work: Path, mode: str = "subprocess", log: Callable[[str], None] = print,
                 env: Optional[dict[str, str]] = None):
        self.work, self.mode, self.log = work, mode, log
        self.env = env  # extra environment variables of the stage processes (subprocess mode)
        self.records = work / "stages"

    def record_path(self, name: str) -> Path:
        return self.records / (name.replace(":", "__") + ".json")

    def record(self, stage: Stage) -> Optional[dict[str, Any]]:
        p = self.record_path(stage.name)
        from pyterrier_cpdae._files import read_config_file
        return read_config_file(p) if p.exists() else None  # (a damaged record: one line naming it)

    def save_record(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Write a stage record (``stage``, ``command``, ``wall_s``, ...) atomically."""
        rec = {**rec, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.records.mkdir(parents=True, exist_ok=True)
        path = self.record_path(rec["stage"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, path)
        return rec

    def _write_record(self, stage: Stage, wall: Optional[float], how: str) -> dict[str, Any]:
        return self.save_record({"stage": stage.name, "command": stage.command, "output": str(stage.output),
                                 "wall_s": None if wall is None else round(wall, 1), "wall_how": how,
                                 "encoder_sequences": stage.sequences()})

    def adopt(self, stage: Stage) -> dict[str, Any]:
        """Record a stage finished outside this pipeline (e.g. the base run started by hand)."""
        rec = self.record(stage)
        if rec is not None and rec.get("command") == stage.command:
            return rec
        end = stage.output / "config.json"
        wall = adopted_wall(stage.output, end) if end.exists() else None
        return self._write_record(stage, wall, "file times (the earliest file of the output -> config.json): "
                                               "finished outside this pipeline, lower bound if it was resumed")

    def run(self, stage: Stage) -> dict[str, Any]:
        state = stage.state()
        if state == "done":
            return self.adopt(stage)
        if state.startswith("conflict"):
            raise StageError(f"stage {stage.name}: {state}. Delete {stage.output} to run it again with this "
                             "config, or use another --work-dir.")
        if state == "running":
            who = (f"process {stage.owner()} is running it" if stage.owner() is not None else
                   f"it was written to {stage.last_write():.0f} s ago: it looks like it is still running")
            raise StageError(f"stage {stage.name}: {stage.output} is unfinished and {who}. Wait for it to finish "
                             f"(a run started outside this pipeline and killed is resumed with --resume once it has "
                             f"not been written to for {RUNNING_WINDOW_S} s).")
        resume = ["--resume_from_checkpoint", "true"] if stage.kind == "pretrain" else ["--resume"]
        argv = stage.argv + (resume if state == "resume" else [])
        self.log(f"[{stage.name}] {'resuming' if state == 'resume' else 'running'}: python -m pretrain "
                 + " ".join(shlex.quote(a) for a in argv))
        stage.output.parent.mkdir(parents=True, exist_ok=True)
        # while this process lives the stage is "running"; after a crash the dead pid makes it "resume" at once
        stage.pid_file.write_text(f"{os.getpid()}\n")
        wall = self._execute(stage, argv)
        stage.pid_file.unlink(missing_ok=True)
        if not stage.finished():
            raise StageError(f"stage {stage.name}: the command returned but {stage.output} holds no finished run")
        prev = self.record(stage) if state == "resume" else None
        how = "measured by the pipeline" + (" (this part only: resumed)" if state == "resume" else "")
        return self._write_record(stage, wall if prev is None else wall + (prev.get("wall_s") or 0), how)

    def _execute(self, stage: Stage, argv: list[str]) -> float:
        """Run ``python -m pretrain ARGV``; returns its wall time."""
        t0 = time.perf_counter()
        if self.mode == "inprocess":
            from pretrain.cli import main as pretrain_main
            pretrain_main(list(argv))
        else:
            logf = stage.output.parent / f"{stage.output.name}.log"
            with open(logf, "a") as f:
                proc = subprocess.run([sys.executable, "-m", "pretrain", *argv], cwd=ROOT, stdout=f,
                                      stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})})
            if proc.returncode != 0:
                tail = logf.read_text(errors="replace")[-3000:]
                raise StageError(f"stage {stage.name} failed (exit {proc.returncode}); its log is {logf}:\n{tail}")
        return time.perf_counter() - t0


def select(names: list[str], patterns: Optional[list[str]]) -> list[str]:
    """The names matching any of the ``fnmatch`` patterns (all with no patterns)."""
    if not patterns:
        return names
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
