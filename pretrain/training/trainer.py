"""Pre-training on the Hugging Face Trainer: :class:`PretrainTrainer` adds only what ``transformers.Trainer`` lacks
for our objectives: the loss terms in every log line; a non-finite loss stopping the run before the update, and no
checkpoint or export from non-finite weights; a resume refused when its length gives the steps taken other rates;
the run directory watched; the objective's weights as one ``model.safetensors``; the retrieval probe as the
evaluation; ``--gradient_checkpointing`` and ``--torch_compile`` on the encoder (the objective is no
``PreTrainedModel``). Cross-device negatives are the objectives' own."""
from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any, Callable, Optional

import torch
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_model, save_model
from transformers import Trainer, TrainerCallback, TrainerState, get_scheduler
from transformers.trainer_utils import sort_checkpoints

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or weight and stopped; nothing was saved from such weights."""


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``module`` holding a NaN or an infinity (one device
    synchronisation)."""
    named = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()]
    bad = (~torch.stack([torch.isfinite(t.detach()).all() for _, t in named])).tolist() if named else []
    return [n for (n, _), b in zip(named, bad) if b]


def last_checkpoint(output: str) -> Optional[str]:
    """The newest complete ``checkpoint-N`` of ``output`` (its ``trainer_state.json``, written last, present)."""
    done = [c for c in sort_checkpoints(output) if os.path.isfile(os.path.join(c, "trainer_state.json"))]
    return done[-1] if done else None


def enable_gradient_checkpointing(module: torch.nn.Module) -> None:
    """``--gradient_checkpointing`` on ``module`` or the HF model inside it (``mlm_model``, ``encoder``, ``model``);
    ValueError if none of them can enable it."""
    for target in (module, *(getattr(module, n, None) for n in ("mlm_model", "encoder", "model"))):
        for name, kw in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # transformers >= 5
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
            if callable(getattr(target, name, None)):
                return getattr(target, name)(**{kw: {"use_reentrant": False}})
    raise ValueError(f"--gradient_checkpointing: {type(module).__name__} has no gradient_checkpointing_enable() "
                     "(nor its mlm_model/encoder)")


def compile_encoder(mlm_model: Any) -> int:
    """``--torch_compile``: ``torch.compile`` every Transformer layer of the encoder in place (the first batch of
    another length recompiles with dynamic shapes); returns the number of layers compiled (ValueError: no
    ``encoder.layer`` list)."""
    layers = getattr(getattr(mlm_model.base_model, "encoder", None), "layer", None)
    if layers is None or not len(layers):
        raise ValueError(f"--torch_compile: {type(mlm_model.base_model).__name__} has no encoder.layer list to compile")
    for layer in layers:
        layer.compile()
    return len(layers)


def lr_factors(args: Any, total: int, steps: int) -> list[float]:
    """The learning-rate factors of the first ``steps`` updates of a run of ``total`` steps (the scheduler the Trainer
    builds from ``args``; none for a schedule that follows a metric, not the length)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(total),
                          num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    return [sched.lr_lambdas[0](k) for k in range(steps)] if hasattr(sched, "lr_lambdas") else [1.0] * steps


class PretrainCallback(TrainerCallback):
    """Stops the run before an update computed from a non-finite loss term (every process at the same step), and
    calls the objective's ``on_step(step, total_steps)`` at the start (a resumed run's schedules continue where they
    were) and after each update."""

    def __init__(self, trainer: "PretrainTrainer"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, terms = self.trainer, self.trainer._step_terms
        trainer._step_terms = {}
        if not terms:
            return
        vals = torch.stack(list(terms.values()))
        if args.world_size > 1:
            vals = trainer.accelerator.reduce(vals, reduction="sum")
        bad = [(k, v) for k, v in zip(terms, vals.tolist()) if not math.isfinite(v)]
        if bad:
            trainer.close_progress_bar()
            raise NonFiniteError(trainer.divergence_message(
                f"step {state.global_step + 1}: the loss term {bad[0][0]} is {bad[0][1]}"
                + (f" (also {', '.join(k for k, _ in bad[1:])})" if len(bad) > 1 else "")))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        fn = getattr(self.trainer.accelerator.unwrap_model(self.trainer.model), "on_step", None)
        if callable(fn):
            fn(state.global_step, state.max_steps)

    on_train_begin = on_step_end


def refuse_ignored_parallelism(trainer: Trainer) -> None:
    """Stop when ``--fsdp`` or ``--deepspeed`` was asked for but the Trainer runs without it: accelerate enables them on
    accelerators only, and on the CPU the run would otherwise train as plain DDP (or one process) without a word."""
    args = trainer.args
    for option, asked, on in (("--fsdp", bool(args.fsdp), trainer.is_fsdp_enabled),
                              ("--deepspeed", bool(args.deepspeed), trainer.is_deepspeed_enabled)):
        if asked and not on:
            raise ValueError(f"{option} was given but the Trainer does not run it on this machine (accelerate enables "
                             f"it on GPUs only; {trainer.accelerator.distributed_type.value} here): drop {option} to "
                             f"train with DDP, or run on GPUs")


class PretrainTrainer(Trainer):
    """``transformers.Trainer`` for our objectives (see the module's docstring): ``probe``, a
    :class:`~pretrain.evaluation.probe.RetrievalProbe` run with ``probe_settings``, is the evaluation; ``place``, the
    run directory's :class:`~pretrain.training.run_dir.OutputPlace`, is checked before each write."""

    def __init__(self, *args_: Any, probe: Any = None, probe_settings: Optional[dict[str, Any]] = None,
                 place: Any = None, **kwargs: Any):
        args = kwargs["args"]  # --gradient_checkpointing / --torch_compile: on the encoder, not the whole objective
        checkpointing, compile_encoder = args.gradient_checkpointing, args.torch_compile
        args.gradient_checkpointing = args.torch_compile = False
        if probe is not None and kwargs.get("eval_dataset") is None:
            kwargs["eval_dataset"] = probe  # the evaluation set is the probe's (the Trainer asks for one)
        super().__init__(*args_, **kwargs)
        refuse_ignored_parallelism(self)
        self.add_callback(PretrainCallback(self))
        self.probe, self.probe_settings, self.place = probe, dict(probe_settings or {}), place
        self._terms, self._step_terms, self._term_batches = {}, {}, 0  # the loss terms of the window, of the step
        if checkpointing:
            enable_gradient_checkpointing(self.model)
        if compile_encoder:
            self.model.compile_encoder()

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = model(**inputs)  # the objective's PretrainingOutput: the loss and its named terms
        if model.training:
            for k, v in out.flat().items():
                v = v.detach().float().reshape(())
                self._step_terms[k] = self._step_terms.get(k, 0.0) + v
                if k != "loss":
                    self._terms[k] = self._terms.get(k, 0.0) + v
            self._term_batches += 1
        return (out.loss, out) if return_outputs else out.loss

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self._term_batches:  # the terms averaged over the logging window and the processes
            vals = torch.stack(list(self._terms.values())) / self._term_batches
            if self.args.world_size > 1:
                vals = self.accelerator.reduce(vals, reduction="mean")
            logs.update({k: float(v) for k, v in zip(self._terms, vals.tolist())})
            self._terms, self._term_batches = {}, 0
        super().log(logs, start_time)

    def _init_training_state(self, max_steps: int, *args: Any, **kwargs: Any) -> Any:
        """Refuses a resume whose length (``--max_steps``, ``--num_train_epochs``) gives the steps already taken other
        learning rates than they ran at (the schedule depends on the total), before anything is loaded."""
        checkpoint = args[2] if len(args) > 2 else kwargs.get("resume_from_checkpoint")
        if checkpoint and os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
            state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
            before, step = state.max_steps, state.global_step
            if before and before != max_steps:
                again = (f"resume with the length it was started with ({before} steps), or start a new run of "
                         f"{max_steps} steps (another --output_dir, or --overwrite_output_dir)")
                if step > max_steps:
                    raise ValueError(f"--resume_from_checkpoint refused: {checkpoint} has trained {step} of its "
                                     f"{before} steps, more than the {max_steps} asked for (--max_steps / "
                                     f"--num_train_epochs); {again}")
                old, new = lr_factors(self.args, before, step), lr_factors(self.args, max_steps, step)
                k = next((k for k in range(step) if old[k] != new[k]), None)
                if k is not None:
                    raise ValueError(f"--resume_from_checkpoint refused: {checkpoint} took its {step} steps on the "
                                     f"learning-rate schedule of a {before}-step run; a run of {max_steps} steps "
                                     f"(--max_steps / --num_train_epochs) sets other rates (step {k + 1}: "
                                     f"{new[k]:.6g} x the peak, not {old[k]:.6g}): {again}")
        return super()._init_training_state(max_steps, *args, **kwargs)

    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        if self.args.should_save:
            output_dir = output_dir or self.args.output_dir
            os.makedirs(output_dir, exist_ok=True)
            save_model(self.accelerator.unwrap_model(self.model), os.path.join(output_dir, WEIGHTS))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = os.path.join(resume_from_checkpoint, WEIGHTS)
        if not os.path.isfile(path):
            raise ValueError(f"{resume_from_checkpoint} holds no {WEIGHTS}: not a checkpoint of this toolkit")
        load_model(self.accelerator.unwrap_model(model or self.model), path, strict=True, device="cpu")

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best and os.path.isfile(os.path.join(best, WEIGHTS)):
            logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
            self._load_from_checkpoint(best)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.check_finite_and_writable(f"checkpoint-{self.state.global_step}")
        super()._save_checkpoint(model, trial)

    def check_finite_and_writable(self, what: str) -> None:
        """Stop, writing nothing, when the run directory was moved or removed (every process stops together) or a
        weight is not finite."""
        problem = self.place.problem() if self.place is not None else None
        if self.args.world_size > 1:
            flag = torch.tensor([0.0 if problem is None else 1.0], device=self.args.device)
            if float(self.accelerator.reduce(flag, reduction="sum").item()) > 0 and problem is None:
                problem = "another process of the run found the output directory moved or removed"
        if problem is not None:
            self.close_progress_bar()
            raise self.place.error(what, problem)
        bad = nonfinite_tensors(self.accelerator.unwrap_model(self.model))
        if bad:
            self.close_progress_bar()
            raise NonFiniteError(self.divergence_message(f"refusing to write {what}: {len(bad)} weight tensor(s) are "
                                                         f"not finite ({', '.join(bad[:3])})"))

    def close_progress_bar(self) -> None:
        """Close the Trainer's progress bar, so that the error line that follows stands on a line of its own."""
        for cb in self.callback_handler.callbacks:
            if getattr(cb, "training_bar", None) is not None:
                cb.training_bar.close()
                cb.training_bar = None

    def divergence_message(self, what: str) -> str:
        """The line that stops a diverged run: ``what`` happened, and the checkpoint to go back to."""
        found = last_checkpoint(self.args.output_dir)
        kept = (f"the last checkpoint, {found}, holds finite weights (resuming it with the same options would "
                "diverge again: start again with --overwrite_output_dir and a lower --learning_rate)" if found else
                "no checkpoint was written before it: start again with a lower --learning_rate")
        return f"training stopped, {what}. Nothing was saved from these weights; {kept}"

    def export(self, write: Callable[[Any], None], dtype: torch.dtype = torch.float32) -> None:
        """``write(objective)`` on the main process (the caller's export, :func:`pretrain.export.commit.commit_export`),
        the objective cast to ``dtype`` on a copy; refused from non-finite weights or into a moved directory."""
        self.check_finite_and_writable("the exported model")
        self.accelerator.wait_for_everyone()
        if self.is_world_process_zero():
            unwrapped = self.accelerator.unwrap_model(self.model)
            write(copy.deepcopy(unwrapped).to(dtype) if dtype != torch.float32 else unwrapped)
        self.accelerator.wait_for_everyone()

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        if self.probe is None:  # (python -m pretrain refuses --eval_strategy without --probe before it starts)
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        objective = self.accelerator.unwrap_model(self.model)
        metrics: dict[str, float] = {}
        if self.is_world_process_zero():  # RetrievalProbe.evaluate restores the encoder's training mode
            figures = self.probe.evaluate(objective.encoder, objective.tokenizer, **self.probe_settings)
            metrics = {f"{metric_key_prefix}_probe_{k}": float(v) for k, v in figures.items()}
        if self.args.world_size > 1:
            metrics = broadcast_object_list([metrics])[0]
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

