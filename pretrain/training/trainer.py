"""Pre-training on the Hugging Face Trainer: :class:`PretrainTrainer` adds only what the plain ``transformers.Trainer``
lacks for our objectives.

* the loss terms (``mlm``, ``rec``, ``cl``, ...) of the objective's output, averaged over the logging window and the
  processes, in every log line (so in ``trainer_state.json``'s log history and every ``--report_to`` backend);
* a non-finite loss term stops the run before the update (:class:`FiniteLossCallback`: one line naming the step
  and the term); no checkpoint or export is written from non-finite weights;
* the output directory watched: a run whose directory was moved or removed stops before it writes again
  (:class:`~pretrain.training.run_dir.OutputPlace`);
* checkpoints are the Trainer's own (``checkpoint-N/`` with ``trainer_state.json``, optimizer, scheduler and RNG
  states, all loaded with ``weights_only``); the objective's weights are one ``model.safetensors`` (tied tensors
  stored once);
* the retrieval probe (``--probe``) as the evaluation: ``eval_probe_ndcg_cut_10`` / ``eval_probe_recip_rank_10``;
* ``--gradient_checkpointing`` and ``--torch_compile`` applied to the objective's encoder (each layer compiled in
  place, so parameter names and checkpoints are unchanged).

Cross-device negatives with gradients are the objectives' own (:mod:`pretrain.model.distributed`).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Optional

import torch
from transformers import Trainer, TrainerCallback

from .finite import NonFiniteError, nonfinite_tensors

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


def last_checkpoint(output: str) -> Optional[str]:
    """The newest complete ``checkpoint-N`` of ``output`` (its ``trainer_state.json``, written last, present)."""
    if not os.path.isdir(output):
        return None
    found = []
    for name in os.listdir(output):
        step = name[len("checkpoint-"):]
        if name.startswith("checkpoint-") and step.isdigit() and \
                os.path.isfile(os.path.join(output, name, "trainer_state.json")):
            found.append((int(step), os.path.join(output, name)))
    return max(found)[1] if found else None


class FiniteLossCallback(TrainerCallback):
    """Stops the run before an update computed from a non-finite loss term (every process stops at the same step)."""

    def __init__(self, trainer: "PretrainTrainer"):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        terms = self.trainer._step_terms
        self.trainer._step_terms = {}
        if not terms:
            return
        keys = list(terms)
        vals = torch.stack([terms[k] for k in keys])
        if args.world_size > 1:
            vals = self.trainer.accelerator.reduce(vals, reduction="sum")
        bad = [(k, v) for k, v in zip(keys, vals.tolist()) if not math.isfinite(v)]
        if bad:
            self.trainer.close_progress_bar()
            raise NonFiniteError(self.trainer.divergence_message(
                f"step {state.global_step + 1}: the loss term {bad[0][0]} is {bad[0][1]}"
                + (f" (also {', '.join(k for k, _ in bad[1:])})" if len(bad) > 1 else "")))


class ObjectiveStepCallback(TrainerCallback):
    """Calls the objective's ``on_step(step, total_steps)`` after each update and once at the start (a resumed run's
    schedules, e.g. the BoW weight's, continue where they were)."""

    def __init__(self, trainer: "PretrainTrainer"):
        self.trainer = trainer

    def _call(self, state: Any) -> None:
        fn = getattr(self.trainer.accelerator.unwrap_model(self.trainer.model), "on_step", None)
        if callable(fn):
            fn(state.global_step, state.max_steps)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._call(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._call(state)


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
    """``transformers.Trainer`` for the objectives of :mod:`pretrain.objectives` (see the module's docstring).

    Args:
        probe: a :class:`pretrain.evaluation.probe.RetrievalProbe` run by :meth:`evaluate`, or ``None``.
        probe_settings: keyword arguments of ``probe.evaluate`` (pooling, normalize, max_length, batch_size).
        place: the run directory's :class:`~pretrain.training.run_dir.OutputPlace` (checked before each write).
        Other arguments: those of ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, probe: Any = None, probe_settings: Optional[dict[str, Any]] = None,
                 place: Any = None, **kwargs: Any):
        train_args = kwargs.get("args")
        self._encoder_setup = {}
        if train_args is not None:  # applied to the encoder here, not by the Trainer to the whole objective
            self._encoder_setup = {"gradient_checkpointing": bool(train_args.gradient_checkpointing),
                                   "torch_compile": bool(train_args.torch_compile)}
            train_args.gradient_checkpointing = False
            train_args.torch_compile = False
        if probe is not None and kwargs.get("eval_dataset") is None:
            kwargs["eval_dataset"] = probe  # the evaluation set is the probe's (the Trainer asks for one)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        super().__init__(*args, callbacks=callbacks, **kwargs)
        refuse_ignored_parallelism(self)
        self.add_callback(FiniteLossCallback(self))
        self.add_callback(ObjectiveStepCallback(self))
        self.probe, self.probe_settings, self.place = probe, dict(probe_settings or {}), place
        self._terms: dict[str, torch.Tensor] = {}
        self._term_batches = 0
        self._step_terms: dict[str, torch.Tensor] = {}
        objective = self.model
        if self._encoder_setup.get("gradient_checkpointing"):
            from .optim import enable_gradient_checkpointing
            enable_gradient_checkpointing(objective)
        if self._encoder_setup.get("torch_compile"):
            objective.compile_encoder()

    # ------------------------------------------------------------------ loss and its terms
    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = self.forward_objective(model, inputs)
        loss = out["loss"]
        terms = out.get("terms") if hasattr(out, "get") else None
        if terms is None:  # an objective returning a flat dict: its other scalar entries are the terms
            terms = {k: v for k, v in out.items() if k != "loss" and torch.is_tensor(v) and v.numel() == 1}
        if model.training:
            for k, v in {"loss": loss, **terms}.items():
                v = v.detach().float().reshape(())
                self._step_terms[k] = self._step_terms.get(k, 0.0) + v
                if k != "loss":
                    self._terms[k] = self._terms.get(k, 0.0) + v
            self._term_batches += 1
        return (loss, out) if return_outputs else loss

    @staticmethod
    def forward_objective(model: Any, inputs: dict[str, Any]) -> Any:
        """``model(**inputs)``: the objective's ``PretrainingOutput`` for a collated batch."""
        return model(**inputs)

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        if "loss" in logs and self._term_batches:
            keys = list(self._terms)
            vals = torch.stack([self._terms[k] for k in keys]) / self._term_batches
            if self.args.world_size > 1:
                vals = self.accelerator.reduce(vals, reduction="mean")
            logs.update({k: float(v) for k, v in zip(keys, vals.tolist())})
            self._terms, self._term_batches = {}, 0
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        from safetensors.torch import save_model

        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        save_model(self.accelerator.unwrap_model(self.model), os.path.join(output_dir, WEIGHTS))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        from safetensors.torch import load_model

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
        name = f"checkpoint-{self.state.global_step}"
        self.check_writable(f"checkpoint {name}")
        bad = nonfinite_tensors(self.accelerator.unwrap_model(self.model))
        if bad:
            self.close_progress_bar()
            raise NonFiniteError(self.divergence_message(f"refusing to write {name}: {len(bad)} weight tensor(s) are "
                                                         f"not finite ({', '.join(bad[:3])})"))
        super()._save_checkpoint(model, trial)

    def check_writable(self, what: str) -> None:
        """Stop, writing nothing, when the run directory was moved or removed (every process stops together)."""
        problem = self.place.problem() if self.place is not None else None
        if self.args.world_size > 1:
            flag = torch.tensor([0.0 if problem is None else 1.0], device=self.args.device)
            if float(self.accelerator.reduce(flag, reduction="sum").item()) > 0 and problem is None:
                problem = "another process of the run found the output directory moved or removed"
        if problem is not None:
            self.close_progress_bar()
            raise self.place.error(what, problem)

    def close_progress_bar(self) -> None:
        """Close the Trainer's progress bar, so that the error line that follows stands on a line of its own."""
        from transformers.trainer_callback import ProgressCallback

        for cb in self.callback_handler.callbacks:
            if isinstance(cb, ProgressCallback) and cb.training_bar is not None:
                cb.training_bar.close()
                cb.training_bar = None

    def divergence_message(self, what: str) -> str:
        found = last_checkpoint(self.args.output_dir)
        kept = (f"the last checkpoint, {found}, holds finite weights (resuming it with the same options would "
                "diverge again: start again with --overwrite_output_dir and a lower --learning_rate)" if found else
                "no checkpoint was written before it: start again with a lower --learning_rate")
        return f"training stopped, {what}. Nothing was saved from these weights; {kept}"

    # ------------------------------------------------------------------ export
    def export(self, write: Callable[[Any], None], dtype: torch.dtype = torch.float32) -> None:
        """``write(objective)`` on the main process (the caller's export: saved into a temporary folder, checked and
        moved into ``output_dir``, :func:`pretrain.export.commit.commit_export`), the objective cast to ``dtype``
        on a copy; refused from non-finite weights or into a moved directory."""
        import copy

        unwrapped = self.accelerator.unwrap_model(self.model)
        self.check_writable("the exported model")
        bad = nonfinite_tensors(unwrapped)
        if bad:
            raise NonFiniteError(self.divergence_message(f"refusing to write the exported model: {len(bad)} weight "
                                                         f"tensor(s) are not finite ({', '.join(bad[:3])})"))
        self.accelerator.wait_for_everyone()
        if self.is_world_process_zero():
            write(copy.deepcopy(unwrapped).to(dtype) if dtype != torch.float32 else unwrapped)
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ the retrieval probe
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        if self.probe is None:
            if eval_dataset is None and self.eval_dataset is None:
                raise ValueError("--eval_strategy asks for an evaluation, but there is nothing to evaluate: give "
                                 "--probe SET (a local dataset folder or an ir_datasets id)")
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        objective = self.accelerator.unwrap_model(self.model)
        metrics: dict[str, float] = {}
        if self.is_world_process_zero():
            was_training = objective.training
            objective.eval()
            try:
                with torch.no_grad():
                    figures = self.probe.evaluate(objective.encoder, objective.tokenizer, **self.probe_settings)
            finally:
                objective.train(was_training)
            metrics = {f"{metric_key_prefix}_probe_{k}": float(v) for k, v in figures.items()}
        if self.args.world_size > 1:
            from accelerate.utils import broadcast_object_list
            metrics = broadcast_object_list([metrics])[0]
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


__all__ = ["PretrainTrainer", "FiniteLossCallback", "ObjectiveStepCallback", "last_checkpoint", "NonFiniteError"]
