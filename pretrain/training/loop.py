"""A small, generic training loop on Hugging Face Accelerate.

:class:`Trainer` trains any ``nn.Module`` whose ``forward(batch)`` returns a dict with a
``"loss"`` tensor (plus any scalar loss components to log) on a map-style dataset and a
``collate_fn``. It is used for pre-training (``python -m pretrain``) and bi-encoder
fine-tuning (``python -m pretrain finetune``).

Features: AdamW (no weight decay on biases and LayerNorm weights; the fused kernel on CUDA), linear warm-up then
linear decay, gradient clipping and accumulation, bf16/fp16 autocast on CUDA, gradient
checkpointing, optional ``torch.compile`` (``--compile``), DDP under ``torchrun``/``accelerate launch`` with a *global* batch size,
a seeded deterministic data order, atomic resumable checkpoints ``checkpoint-N`` (model,
optimizer, scheduler, RNG states and data position, stored as safetensors/JSON and never
unpickled, see :mod:`pretrain.training.checkpoint`: a run killed and resumed reproduces the loss
sequence of an uninterrupted run), CSV/TensorBoard/W&B logs and a loss-curve plot.

Numbers: the master weights are float32 (:func:`ensure_float32`; autocast adds bf16/fp16 compute) and the export
is written in ``--save-dtype`` from a cast copy. A non-finite loss term or gradient norm (checked before each
update, :class:`FiniteGuard`) or weight (checked after each update and before every checkpoint and export)
raises :class:`NonFiniteError` naming the step, the terms and the last checkpoint, which stays intact; nothing
is ever written from non-finite weights. On a GPU a step waits for the device once, when it reads its losses and
gradient norm back for that check; the weight check after an update is queued and read with the next step's
(or before the log row, checkpoint or export that follows it), still reported as the step whose update failed,
and the next batch is copied to the device without waiting.

Data order: epoch ``e`` uses the permutation ``torch.randperm(len(dataset))`` drawn from a
generator seeded with ``seed + e``. Optimizer step ``s`` of the epoch consumes the global
batch ``perm[s*B:(s+1)*B]`` (``B = batch_size``; the last incomplete batch is dropped),
cut into ``world_size * grad_accum`` micro-batches: micro-batch ``a`` of rank ``r`` is
chunk ``a * world_size + r``. The examples of a global batch therefore do not depend on
the number of processes or on accumulation.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import os
import shutil
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pyterrier_cpdae._files import write_json_atomic

from ..config import TrainConfig
from .checkpoint import (checkpoint_name, list_checkpoints, load_checkpoint, rng_file,
                         save_rng_state, save_train_state, write_trainer_state)
from .finite import FiniteGuard, NonFiniteError, _fmt, nonfinite_flags, nonfinite_tensors
from .optim import (_default_save, adamw_options, check_resume_length, compile_module, compiled_graphs,
                    enable_gradient_checkpointing, ensure_float32, parameter_groups, resolve_mixed_precision,
                    resolve_save_dtype, warmup_steps)
from .run_dir import RUN_CONFIG, OutputPlace, RunDirectoryError, _clear_previous_run, check_output_dir, config_dict
from .sampler import GlobalBatchSampler

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """Train ``module`` on ``dataset`` with the options of ``config``.

    Args:
        module: An ``nn.Module`` whose ``forward(batch)`` returns ``{"loss": tensor, <name>: tensor, ...}``;
            every scalar entry is logged. Optional ``on_step(step, total_steps)`` is called after each
            optimizer step (and once after resuming).
        dataset: A map-style dataset (``len`` and ``__getitem__``).
        collate_fn: Turns a list of examples into a batch (a dict of tensors, moved to the device here).
        config: A :class:`~pretrain.config.TrainConfig` (or subclass).
        save_fn: ``save_fn(unwrapped_module, directory)`` exports the trained model at the end (main
            process only); defaults to ``module.save_pretrained(directory)``.
    """

    def __init__(self, module: nn.Module, dataset: Dataset, collate_fn: Callable[[list], Any], config: TrainConfig,
                 save_fn: Optional[Callable[[nn.Module, str], None]] = None):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        if not config.output:
            raise ValueError("no output directory given (config.output / --output)")
        from ..logging_utils import parse_report_to
        parse_report_to(config.report_to)
        if config.batch_size < 1 or config.grad_accum < 1:
            raise ValueError(f"batch_size ({config.batch_size}) and grad_accum ({config.grad_accum}) must be >= 1")
        if save_fn is None:
            if not callable(getattr(module, "save_pretrained", None)):
                raise ValueError(f"{type(module).__name__} has no save_pretrained(); pass save_fn")
            save_fn = _default_save
        self.save_dtype = resolve_save_dtype(getattr(config, "save_dtype", "float32"))
        ensure_float32(module)
        self.module = module
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.config = config
        self.save_fn = save_fn
        self.mixed_precision = resolve_mixed_precision(config.mixed_precision, config.cpu)
        ddp = DistributedDataParallelKwargs(find_unused_parameters=getattr(module, "ddp_find_unused_parameters", True))
        # cpu=True without CUDA too: only then does accelerate set up gloo DDP for CPU processes under torchrun
        self.accelerator = Accelerator(mixed_precision=self.mixed_precision,
                                       cpu=config.cpu or not torch.cuda.is_available(), kwargs_handlers=[ddp])
        self.world_size = self.accelerator.num_processes
        if config.batch_size % (self.world_size * config.grad_accum):
            raise ValueError(f"batch_size {config.batch_size} (global) must be divisible by world_size x grad_accum = "
                             f"{self.world_size} x {config.grad_accum}; the per-process micro-batch would be "
                             f"{config.batch_size / (self.world_size * config.grad_accum):g}")
        self.micro_batch_size = config.batch_size // (self.world_size * config.grad_accum)
        n = len(dataset)
        if n == 0:
            raise ValueError("the training dataset is empty")
        self.sampler = GlobalBatchSampler(n, config.batch_size, config.grad_accum, self.accelerator.process_index,
                                          self.world_size, config.seed)
        self.steps_per_epoch = self.sampler.steps_per_epoch
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training dataset holds {n} examples, fewer than one global batch "
                             f"(batch_size {config.batch_size}); lower --batch-size or add data")
        if config.max_steps and config.max_steps > 0:
            self.total_steps = int(config.max_steps)
        else:
            self.total_steps = int(math.ceil(config.epochs * self.steps_per_epoch))
        if self.total_steps <= 0:
            raise ValueError(f"no optimizer steps to run (epochs={config.epochs}, max_steps={config.max_steps})")
        self.warmup_steps = warmup_steps(self.total_steps, config.warmup_ratio)
        if self.total_steps == 1 and self.warmup_steps >= 1 and config.warmup_ratio < 1:
            # the linear warm-up starts at 0 and the ceiling makes any warm-up ratio cover the only step: the run
            # would finish, saved and exit 0, with the weights it started from (--warmup-ratio 1 asks for that)
            length = (f"max_steps {config.max_steps}" if config.max_steps and config.max_steps > 0
                      else f"epochs {config.epochs:g}")
            raise ValueError(
                f"one optimizer step ({n} examples, batch_size {config.batch_size}, {length}) "
                f"with warmup_ratio {config.warmup_ratio:g} runs that step at learning rate 0 (the warm-up starts at 0 "
                f"and rounds up to the whole run): nothing would be trained. Give more steps (--epochs, --max-steps, "
                f"more data or a smaller --batch-size) or set --warmup-ratio 0")
        self.output = config.output
        #: What the run is built from (corpus and tokenizer fingerprints), recorded in run_config.json.
        self.inputs: dict[str, Any] = {}
        #: How the module resolved what it runs (its ``path_record()``, after the path probe), in run_config.json.
        self.resolved: dict[str, Any] = {}

    # --------------------------------------------------------------- public API
    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def train(self) -> dict[str, Any]:
        """Run (or resume) training, export the model and return the final metrics.

        Raises:
            RunDirectoryError: the output directory was moved or removed while the run wrote into it (checked at
                each log row, checkpoint and before the export; see :class:`OutputPlace`).
        """
        acc, cfg = self.accelerator, self.config
        check_output_dir(cfg)
        recorded = self._recorded_resolution() if cfg.resume else {}  # read before the record is written again
        acc.wait_for_everyone()
        found = list_checkpoints(self.output) if cfg.resume and os.path.isdir(self.output) else []
        resume = found[-1] if found else None
        #: what the resumed run resolved at its start (its path probe's choice), kept by the continuation
        self._resume_resolved = recorded if resume is not None else {}
        if cfg.resume and resume is None:
            logger.warning("--resume given but %s holds no checkpoint; starting from scratch", self.output)
        if resume is not None:  # before anything is written: a refused length leaves the run as it was
            check_resume_length(self.output, self.total_steps, cfg.warmup_ratio, self._asked_length())
        if self.is_main_process:
            if cfg.overwrite and not cfg.resume and os.path.isdir(self.output):
                _clear_previous_run(self.output)
            os.makedirs(self.output, exist_ok=True)
            ckpt_root = os.path.join(self.output, "checkpoints")
            if os.path.isdir(ckpt_root):  # leftovers of a checkpoint interrupted while being written
                for name in os.listdir(ckpt_root):
                    if name.startswith(".tmp-"):
                        shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)
            write_json_atomic(os.path.join(self.output, RUN_CONFIG), self._run_config(), default=str)
        acc.wait_for_everyone()
        self._place = OutputPlace(self.output, RUN_CONFIG)
        try:
            return self._train(resume)
        except RunDirectoryError:
            if getattr(self, "_bar", None) is not None:
                self._bar.close()  # the error line starts on a line of its own
            raise
        finally:
            self._place.close()

    def _train(self, resume: Optional[tuple[int, str]]) -> dict[str, Any]:
        from accelerate.utils import set_seed
        from transformers import get_linear_schedule_with_warmup

        acc, cfg = self.accelerator, self.config

        set_seed(cfg.seed, device_specific=True)
        module = self.module
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(module)
        graphs_before = compiled_graphs()
        if getattr(cfg, "compile", False):
            compile_module(module)
        optimizer = torch.optim.AdamW(parameter_groups(module, cfg.weight_decay), lr=cfg.learning_rate,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                                      **adamw_options(acc.device))
        scheduler = get_linear_schedule_with_warmup(optimizer, self.warmup_steps, self.total_steps)
        # the scheduler is not prepared: accelerate would step it once per process
        model, optimizer = acc.prepare(module, optimizer)

        step, epoch, pos = 0, 0, 0
        restored_window: dict[str, Any] = {}
        if resume is not None:
            # safetensors / weights-only tensors / JSON, verified against the checkpoint's manifest
            state = load_checkpoint(self.output, resume[0], resume[1], acc.unwrap_model(model), optimizer, scheduler,
                                    scaler=acc.scaler, rank=acc.process_index, world_size=self.world_size,
                                    device=acc.device)
            step, epoch, pos = state["step"], state["epoch"], state["step_in_epoch"]
            restored_window = state.get("log_window", {})
            # the optimizer's learning rate is what the checkpoint's schedule set after its last step: recomputed
            # from this run's schedule at that step (another total is accepted only when the steps taken had this
            # schedule's rates, check_resume_length; the next step's rate is then this schedule's, not the old end's)
            for group, lr_lambda, base_lr in zip(optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs):
                group["lr"] = base_lr * lr_lambda(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
            logger.info("resumed from %s (step %d, epoch %d, step in epoch %d)", resume[1], step, epoch, pos)
            self._on_step(model, step)
        self._choose_path(model, epoch, pos)

        if self.is_main_process:  # --report-to, through accelerate's trackers
            from ..logging_utils import make_trackers
            acc.log_with = make_trackers(cfg.report_to, os.path.join(self.output, "logs"),
                                         resume_step=step if resume else None,
                                         run_name=os.path.basename(os.path.abspath(self.output)))
            acc.init_trackers("pretrain")

        self._guard = FiniteGuard(loss_scaling=acc.scaler is not None)
        self._pending_update: Optional[dict[str, Any]] = None
        self.last_losses: dict[str, float] = {}
        from tqdm.auto import tqdm
        bar = self._bar = tqdm(total=self.total_steps, initial=step, disable=not acc.is_local_main_process,
                               desc="train", dynamic_ncols=True)
        # losses summed since the last log row (restored when resuming between two log steps, so that
        # the logged averages equal those of an uninterrupted run)
        window = {k: torch.tensor(v, device=acc.device) for k, v in restored_window.get("sums", {}).items()}
        window_steps, window_start = int(restored_window.get("steps", 0)), time.perf_counter()
        last: dict[str, float] = {}
        t0 = time.perf_counter()
        model.train()
        while step < self.total_steps:
            self.sampler.set_position(epoch, pos)
            loader = DataLoader(self.dataset, batch_size=self.micro_batch_size, sampler=self.sampler,
                                collate_fn=self.collate_fn, num_workers=cfg.num_workers, drop_last=False,
                                # own generator: creating the iterator must not consume the global RNG
                                generator=torch.Generator().manual_seed(cfg.seed + epoch),
                                pin_memory=acc.device.type == "cuda")
            batches = iter(loader)
            while step < self.total_steps:
                try:
                    losses = self._optimizer_step(model, optimizer, scheduler, batches, step + 1)
                    if (step + 1) % max(1, cfg.logging_steps) == 0 or step + 1 == self.total_steps or (
                            cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0):
                        self._settle_update_check()  # before the log row or checkpoint of this step
                except NonFiniteError as e:
                    bar.close()
                    raise NonFiniteError(self._divergence_message(str(e))) from None
                lr = losses.pop("_lr")
                step += 1
                pos += 1
                if pos == self.steps_per_epoch:
                    epoch, pos = epoch + 1, 0
                self._on_step(model, step)
                for k, v in losses.items():
                    window[k] = window.get(k, torch.zeros((), device=v.device)) + v
                window_steps += 1
                last = dict(self.last_losses)  # the floats the step's check read back: no synchronisation here
                bar.update(1)
                bar.set_postfix({k: f"{v:.4g}" for k, v in last.items()}, refresh=False)
                if step % max(1, cfg.logging_steps) == 0 or step == self.total_steps:
                    self._check_output(f"the log of step {step}")
                    row = self._reduce_window(window, window_steps)
                    elapsed = max(time.perf_counter() - window_start, 1e-9)
                    row = {"step": step, "epoch": epoch + pos / self.steps_per_epoch, "lr": lr, **row,
                           "seqs_per_s": cfg.batch_size * window_steps / elapsed}
                    acc.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=step)
                    last = row
                    window, window_steps, window_start = {}, 0, time.perf_counter()
                if (cfg.save_steps > 0 and step % cfg.save_steps == 0) or step == self.total_steps:
                    self._save_checkpoint(model, optimizer, scheduler, step, epoch, pos, window, window_steps)
                if pos == 0:  # epoch finished: new permutation
                    break
        bar.close()
        runtime = time.perf_counter() - t0
        self._check_output("the loss curves and the exported model")
        if self.is_main_process:
            for tracker in acc.trackers:  # (not acc.end_training(): it would end the process group)
                tracker.finish()
            acc.trackers = []
            from ..logging_utils import cl_band_batch, plot_metrics, read_metrics
            csv_path = os.path.join(self.output, "logs", "metrics.csv")
            rows = len(read_metrics(csv_path)) if os.path.exists(csv_path) else 0
            if rows >= 2:
                band = cl_band_batch(self.config)
                plot_metrics(csv_path, os.path.join(self.output, "logs", "loss_curves.png"),
                             cl_batch_size=band and band[0], cl_temperature=band[1] if band else 1.0)
            elif rows:  # one point is not a curve (and the figure costs ~0.5 s: most of a few-step run's tail)
                logger.info("loss curves not plotted: %s holds 1 logged row, a curve needs 2 (see --logging-steps)",
                            csv_path)
        self._export(model)
        result = {k: v for k, v in last.items() if k not in ("seqs_per_s",)}
        result.update({"step": step, "total_steps": self.total_steps, "train_runtime_s": runtime,
                       "output": self.output})
        if getattr(cfg, "compile", False):  # first compilations and recompilations of this run's steps
            result["compiled_graphs"] = compiled_graphs() - graphs_before
            logger.info("--compile: %d graphs compiled in this run (each compiled layer's first batch, then one per "
                        "new shape until shapes are dynamic)", result["compiled_graphs"])
        return result

    # --------------------------------------------------------------- internals
    def _choose_path(self, model: nn.Module, epoch: int, pos: int) -> None:
        """The path probe (:mod:`pretrain.training.path_probe`) of a module that offers paths to time on this device
        (``probe_paths(device)``, e.g. ``--unpad auto`` on CUDA): a few forward and backward passes of the run's first
        micro-batch on each, no update, gradients dropped, random states restored; the fastest is kept
        (``use_path(path, times)``; every process keeps the same, from the times averaged over processes). A resumed
        run keeps the path its start chose (the module's ``recorded_path(record)`` of the run's ``resolved`` record), so
        that the continuation computes as the run did. Then the module's ``path_record()`` goes into
        ``run_config.json`` as ``resolved``."""
        from .path_probe import fastest, preserved_random_state, time_paths

        acc = self.accelerator
        unwrapped = acc.unwrap_model(model)
        probe = getattr(unwrapped, "probe_paths", None)
        paths = tuple(probe(acc.device)) if callable(probe) else ()
        recorded = getattr(unwrapped, "recorded_path", None)
        kept = recorded(getattr(self, "_resume_resolved", {})) if paths and callable(recorded) else None
        if kept is not None:  # a resumed run keeps its path: the continuation computes as the run did
            logger.info("resumed run: keeping the path its start chose (%s)", kept[0])
            unwrapped.use_path(*kept)
        elif paths:
            from accelerate.utils import send_to_device

            self.sampler.set_position(epoch, pos)
            examples = [self.dataset[i] for i in itertools.islice(iter(self.sampler), self.micro_batch_size)]
            was_training = model.training
            model.train()
            batches: dict[str, Any] = {}
            with preserved_random_state(unwrapped):
                for path in paths:  # each path's batch from the same random state: the same masks
                    with preserved_random_state(unwrapped):
                        unwrapped.use_path(path)
                        batches[path] = send_to_device(self.collate_fn(examples), acc.device)

                def step(path: str) -> None:
                    unwrapped.use_path(path)
                    acc.backward(model(batches[path])["loss"])

                sync = (lambda: torch.cuda.synchronize(acc.device)) if acc.device.type == "cuda" else (lambda: None)
                times = time_paths(step, paths, sync=sync)
                for p in model.parameters():
                    p.grad = None
            del batches
            if self.world_size > 1:  # one choice on every process
                mean = acc.reduce(torch.tensor([times[p] for p in paths], dtype=torch.float64, device=acc.device),
                                  reduction="mean")
                times = dict(zip(paths, mean.tolist()))
            unwrapped.use_path(fastest(times), times)
            model.train(was_training)
        record = getattr(unwrapped, "path_record", None)
        self.resolved = dict(record()) if callable(record) else {}
        if self.resolved and self.is_main_process:
            write_json_atomic(os.path.join(self.output, RUN_CONFIG), self._run_config(), default=str)

    def _recorded_resolution(self) -> dict[str, Any]:
        """The ``resolved`` record of the run in ``output`` (``{}`` without one)."""
        import json

        try:
            with open(os.path.join(self.output, RUN_CONFIG)) as f:
                record = json.load(f).get("resolved")
        except (OSError, ValueError, AttributeError):
            return {}
        return record if isinstance(record, dict) else {}

    def _asked_length(self) -> str:
        cfg = self.config
        if cfg.max_steps and cfg.max_steps > 0:
            return f"--max-steps {cfg.max_steps}"
        return f"--epochs {cfg.epochs:g} of {self.steps_per_epoch} steps"

    def _run_config(self) -> dict[str, Any]:
        import accelerate
        import transformers
        return {"config": config_dict(self.config),
                # where the run is (run_moved tells a run directory moved since from this)
                "output_path": os.path.realpath(self.output),
                "trainer": {"world_size": self.world_size, "micro_batch_size": self.micro_batch_size,
                            "grad_accum": self.config.grad_accum, "mixed_precision": self.mixed_precision,
                            "master_dtype": "float32",
                            "save_dtype": str(self.save_dtype).replace("torch.", ""),
                            "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                            "warmup_steps": self.warmup_steps, "num_examples": len(self.dataset),
                            "module": type(self.module).__name__},
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "accelerate": accelerate.__version__},
                # what the run is built from (set by the caller, e.g. pretrain.data.inputs.run_inputs)
                **({"inputs": self.inputs} if self.inputs else {}),
                # what the module resolved at the start (e.g. --unpad auto's path and its probe's times)
                **({"resolved": self.resolved} if self.resolved else {})}

    def _optimizer_step(self, model: nn.Module, optimizer: Any, scheduler: Any, batches: Iterator[Any],
                        step: int) -> dict[str, torch.Tensor]:
        """Optimizer step ``step`` (1-based): forward/backward over the micro-batches, then the update.

        Raises:
            NonFiniteError: before the update for a non-finite loss term or gradient norm (see
                :class:`FiniteGuard`), after it when the update made a weight non-finite.
        """
        from accelerate.utils import send_to_device

        acc, cfg = self.accelerator, self.config
        sums: dict[str, torch.Tensor] = {}
        # on CUDA the batch (pinned by the loader) is copied without waiting: a blocking copy would wait for the
        # previous step's queued work, one more device synchronisation per micro-batch
        non_blocking = acc.device.type == "cuda"
        for a in range(cfg.grad_accum):
            batch = send_to_device(next(batches), acc.device, non_blocking=non_blocking)
            sync = contextlib.nullcontext() if a == cfg.grad_accum - 1 else acc.no_sync(model)
            with sync:
                out = model(batch)
                if not isinstance(out, dict) or "loss" not in out:
                    raise TypeError(f"{type(self.module).__name__}.forward must return a dict with a 'loss' entry")
                if isinstance(out.get("terms"), dict):  # an objective's PretrainingOutput: loss + named terms
                    out = {"loss": out["loss"], **out["terms"]}
                acc.backward(out["loss"] / cfg.grad_accum)
            for k, v in out.items():
                if torch.is_tensor(v) and v.numel() == 1:
                    sums[k] = sums.get(k, 0.0) + v.detach().float().reshape(()) / cfg.grad_accum
        # the total gradient norm (unscaled under fp16; max_norm=inf only measures it)
        clip = cfg.max_grad_norm if cfg.max_grad_norm and cfg.max_grad_norm > 0 else math.inf
        grad_norm = acc.clip_grad_norm_(model.parameters(), clip)
        # the losses and the norm, summed over processes (a NaN anywhere is a NaN everywhere, so that every
        # process stops at the same step), checked before the update touches the weights; read in the step's one
        # device synchronisation together with the previous update's weight check (see _settle_update_check)
        keys = list(sums)
        vals = torch.stack([sums[k] for k in keys] + [torch.as_tensor(
            grad_norm if grad_norm is not None else 0.0, dtype=torch.float32, device=acc.device).reshape(())])
        pending, self._pending_update = self._pending_update, None
        if pending is not None:
            vals = torch.cat([vals, pending["bad"]])
        if self.world_size > 1:
            vals = acc.reduce(vals.clone(), reduction="sum")
        vals = vals.tolist()
        if pending is not None:
            self._raise_for_update(pending, vals[len(keys) + 1:])
            vals = vals[:len(keys) + 1]
        losses = {k: v / self.world_size for k, v in zip(keys, vals)}
        self._guard.check(step, losses, vals[-1] / self.world_size)
        self.last_losses = losses
        sums["_lr"] = scheduler.get_last_lr()[0]  # the rate applied in this update
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # did the update make a weight non-finite? Queued here, read at the next synchronisation (the next step's
        # check, a log row, a checkpoint, the export) and reported as this step's
        names, bad = nonfinite_flags(acc.unwrap_model(model))
        if bad is not None:
            self._pending_update = {"step": step, "lr": sums["_lr"], "losses": losses, "names": names, "bad": bad}
        return sums

    def _raise_for_update(self, pending: dict[str, Any], bad: list[float]) -> None:
        """Raise :class:`NonFiniteError` naming ``pending``'s step when its update made a weight non-finite (``bad``:
        the per-tensor flags read back, summed over processes)."""
        names = [n for n, b in zip(pending["names"], bad) if b > 0]
        if names:
            raise NonFiniteError(f"step {pending['step']}: the update (learning rate {pending['lr']:.4g}) made "
                                 f"{len(names)} weight tensor(s) non-finite ({', '.join(names[:3])}"
                                 f"{', ...' if len(names) > 3 else ''}) from finite losses ({_fmt(pending['losses'])})")

    def _settle_update_check(self) -> None:
        """Read the last update's weight check now (one synchronisation), before a log row, checkpoint or export.

        Raises:
            NonFiniteError: that update made a weight non-finite.
        """
        pending, self._pending_update = self._pending_update, None
        if pending is None:
            return
        bad = pending["bad"]
        if self.world_size > 1:
            bad = self.accelerator.reduce(bad.clone(), reduction="sum")
        self._raise_for_update(pending, bad.tolist())

    def _divergence_message(self, what: str) -> str:
        """The error of a run stopped by :class:`NonFiniteError`: what happened, what is on disk, what to do."""
        found = list_checkpoints(self.output)
        if found:
            kept = (f"the last checkpoint, {found[-1][1]} (step {found[-1][0]}), holds finite weights and "
                    "resumes with --resume (the same options would diverge again: start again with --overwrite and "
                    "a lower --learning-rate, or find the data that breaks the loss)")
        else:
            kept = ("no checkpoint was written before it: start again with --overwrite and a lower --learning-rate "
                    "(or find the data that breaks the loss)")
        return (f"training stopped, {what}. Nothing was saved from these weights (no checkpoint, no exported "
                f"model); {kept}")

    def _check_finite(self, module: nn.Module, what: str) -> None:
        """Refuse to write ``what`` from weights that hold a NaN or an infinity."""
        bad = nonfinite_tensors(module)
        if bad:
            raise NonFiniteError(self._divergence_message(
                f"refusing to write {what}: {len(bad)} weight tensor(s) are not finite "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"))

    def _check_output(self, what: str) -> None:
        """Stop, writing nothing, when the output directory is no longer the one the run started in (see
        :class:`OutputPlace`); every process stops together.

        Raises:
            RunDirectoryError: naming the directory, what happened to it and what to do.
        """
        place = getattr(self, "_place", None)
        problem = place.problem() if place is not None else None
        if self.world_size > 1:
            flag = torch.tensor([0.0 if problem is None else 1.0], device=self.accelerator.device)
            if float(self.accelerator.reduce(flag, reduction="sum").item()) > 0 and problem is None:
                problem = "another process of the run found the output directory moved or removed"
        if problem is not None:
            raise place.error(what, problem)

    def _reduce_window(self, window: dict[str, torch.Tensor], n: int) -> dict[str, float]:
        keys = ["loss"] + [k for k in window if k != "loss"]
        keys = [k for k in keys if k in window]
        if not keys:
            return {}
        vals = torch.stack([window[k] for k in keys]) / max(n, 1)
        vals = self.accelerator.reduce(vals, reduction="mean")
        return {k: float(v) for k, v in zip(keys, vals.tolist())}

    def _on_step(self, model: nn.Module, step: int) -> None:
        fn = getattr(self.accelerator.unwrap_model(model), "on_step", None)
        if callable(fn):
            fn(step, self.total_steps)

    def _save_checkpoint(self, model: nn.Module, optimizer: Any, scheduler: Any, step: int, epoch: int, pos: int,
                         window: dict[str, torch.Tensor], window_steps: int) -> None:
        """Write ``<output>/checkpoints/checkpoint-N`` atomically (temp dir, then rename) and prune old ones.

        Every process writes its RNG states; the main process writes the model, optimizer and scheduler
        and, last, ``trainer_state.json`` with the manifest of the files (see :mod:`pretrain.training.checkpoint`).
        """
        acc = self.accelerator
        self._check_finite(acc.unwrap_model(model), f"checkpoint {checkpoint_name(step)}")
        self._check_output(f"checkpoint {checkpoint_name(step)}")
        # unlogged loss sums, averaged over processes (mean(saved + local) = saved + mean(local) on resume)
        log_window = {"steps": window_steps, "sums": self._reduce_window(window, 1) if window_steps else {}}
        root = os.path.join(self.output, "checkpoints")
        final = os.path.join(root, checkpoint_name(step))
        tmp = os.path.join(root, f".tmp-{checkpoint_name(step)}")
        try:
            if self.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            acc.wait_for_everyone()
            save_rng_state(os.path.join(tmp, rng_file(acc.process_index)))
            if self.is_main_process:
                save_train_state(tmp, acc.unwrap_model(model), optimizer, scheduler, acc.scaler)
            acc.wait_for_everyone()
            if self.is_main_process:
                write_trainer_state(tmp, {"step": step, "epoch": epoch, "step_in_epoch": pos,
                                          "total_steps": self.total_steps, "world_size": self.world_size,
                                          "batch_size": self.config.batch_size, "grad_accum": self.config.grad_accum,
                                          "seed": self.config.seed, "log_window": log_window})
        except OSError as e:
            raise self._checkpoint_write_error(step, tmp, e) from e
        if self.is_main_process:
            old = None
            if os.path.exists(final):  # e.g. a resumed run saving the same step again
                old = os.path.join(root, f".tmp-replaced-{checkpoint_name(step)}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            limit = self.config.save_total_limit
            if limit and limit > 0:
                for _, path in list_checkpoints(self.output)[:-limit]:
                    shutil.rmtree(path, ignore_errors=True)
        acc.wait_for_everyone()

    def _checkpoint_write_error(self, step: int, tmp: str, e: OSError) -> OSError:
        """One line for a checkpoint that could not be written (a full disk): its partial files are removed (they
        would only hold the space), the checkpoints before it are untouched, and ``--resume`` continues from the
        newest of them, exactly."""
        if getattr(self, "_bar", None) is not None:
            self._bar.close()  # the error line starts on a line of its own
        shutil.rmtree(tmp, ignore_errors=True)
        found = list_checkpoints(self.output)
        last = (f"the last checkpoint, {found[-1][1]} (step {found[-1][0]}), is intact: free space and run the same "
                "command with --resume to continue from it" if found else
                "no earlier checkpoint exists: free space and run the command again")
        what = os.strerror(e.errno) if e.errno else str(e)
        detail = str(e) if "cannot write" in str(e) else f"{what} ({e.filename or tmp})"
        message = f"checkpoint {checkpoint_name(step)} of {self.output} could not be written: {detail}; {last}"
        return OSError(e.errno, message) if e.errno else OSError(message)

    def _export(self, model: nn.Module) -> None:
        """``save_fn`` into a temp dir, then move the files into ``output`` with ``config.json`` last."""
        acc = self.accelerator
        self._check_finite(acc.unwrap_model(model), "the exported model")
        self._check_output("the exported model")
        acc.wait_for_everyone()
        if self.is_main_process:
            unwrapped = acc.unwrap_model(model)
            if self.save_dtype != torch.float32:  # a cast copy: the float32 master weights stay as they are
                unwrapped = copy.deepcopy(unwrapped).to(self.save_dtype)
            tmp = os.path.join(self.output, ".export-tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            self.save_fn(unwrapped, tmp)
            stale_config = os.path.join(self.output, "config.json")
            if os.path.isfile(stale_config):
                os.remove(stale_config)
            for name in sorted(os.listdir(tmp), key=lambda e: e == "config.json"):
                dst = os.path.join(self.output, name)
                if os.path.isdir(dst) and not os.path.islink(dst):
                    shutil.rmtree(dst)
                elif os.path.lexists(dst):
                    os.remove(dst)
                os.replace(os.path.join(tmp, name), dst)
            os.rmdir(tmp)
        acc.wait_for_everyone()


__all__ = ["Trainer"]
