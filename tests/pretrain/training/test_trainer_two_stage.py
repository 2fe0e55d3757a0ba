"""Two-stage pre-training: stage 1 on Wikipedia, stage 2 on the target corpus
continuing the encoder *and the decoder*; the text representation (--representation cls|mean)."""
from __future__ import annotations

import json

import pytest
import torch

from pretrain import cli


def _common(objective: str) -> list[str]:
    return ["--objective", objective, "--global_batch_size", "4", "--max-length", "64", "--save-steps", "1000",
            "--logging-steps", "1", "--learning-rate", "1e-3", "--max-steps", "2"]


def _decoder_state(objective_module) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t.detach().clone() for k, m in objective_module.decoder_modules().items()
            for n, t in m.state_dict().items()}


def _saved_decoder(run):
    """The exported decoder's tensors, keyed like the objective's ``decoder_modules()`` state."""
    from safetensors.torch import load_file
    d = run / "decoder"
    if (d / "model.safetensors").is_file():  # a Hugging Face model: CPDAE's decoder (the objective's module
        state = load_file(str(d / "model.safetensors"))  # "decoder"), or an ObjectiveHead keyed by module names
        if json.loads((d / "config.json").read_text())["model_type"] == "cpdae_decoder":
            return {f"decoder.{k}": v for k, v in state.items()}
        return state
    return load_file(str(d / "decoder.safetensors"))


@pytest.mark.parametrize("objective", ["cpdae", "retromae"])
def test_stage1_enwiki_then_stage2_scifact_continues_the_decoder(tmp_path, tiny_bert_dir, enwiki_dir, scifact_dir,
                                                                  objective, monkeypatch):
    from transformers import AutoModel

    from pretrain.model.modeling import load_mlm_model

    import pretrain.training.trainer as trainer_mod
    from pyterrier_cpdae import CPDAE

    cache = tmp_path / "cache"
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    cli.main(_common(objective) + ["--model", tiny_bert_dir, "--corpus", f"wiki:{enwiki_dir}", "--max-docs", "20",
                                   "--output_dir", str(stage1), "--cache-dir", str(cache)])
    saved1 = _saved_decoder(stage1)

    seen = {}
    train = trainer_mod.PretrainTrainer.train

    def spy(self, *args, **kwargs):  # the objective as stage 2 starts: step 0
        seen["decoder"] = _decoder_state(self.model)
        seen["encoder"] = {k: v.detach().clone() for k, v in self.model.mlm_model.state_dict().items()}
        return train(self, *args, **kwargs)
    monkeypatch.setattr(trainer_mod.PretrainTrainer, "train", spy)
    # the RetroMAE extension's stage 2 adds span contrast (its Eq. 8, the default form), as the recipe
    # experiments/studies/two_stage_pretraining.sh does for retromae
    span = ["--span-contrast-weight", "1"] if objective == "retromae" else []
    cli.main(_common(objective) + span + ["--model", str(stage1), "--decoder-from", str(stage1),
                                          "--corpus", str(scifact_dir / "corpus.jsonl"), "--max-docs", "30",
                                          "--output_dir", str(stage2), "--cache-dir", str(cache)])
    # at stage-2 step 0 the decoder is stage 1's (not a new one, not the SciFact bias prior) ...
    assert set(seen["decoder"]) == set(saved1)
    for k, v in saved1.items():
        assert torch.equal(seen["decoder"][k], v), k
    # ... and so is the encoder + MLM head
    enc1 = load_mlm_model(str(stage1), new_mlm_head=False).state_dict()  # its MLM head from mlm_head/
    for k, v in enc1.items():
        assert torch.equal(seen["encoder"][k], v), k
    # stage 2 trained both on SciFact (its own token cache beside stage 1's) and exported a loadable encoder
    saved2 = _saved_decoder(stage2)
    assert any(not torch.equal(saved1[k], saved2[k]) for k in saved1)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2
    run = json.loads((stage2 / "run_config.json").read_text())["config"]
    assert run["decoder_from"] == str(stage1) and run["model"] == str(stage1)
    if span:
        from pretrain.analysis.loss_curves import read_metrics
        assert run["span_contrast_form"] == "eq8" and run["span_contrast_weight"] == 1.0
        rows = read_metrics(str(stage2))
        assert rows and all(r["span"] > 0 for r in rows if "span" in r) and any("span" in r for r in rows)
    assert AutoModel.from_pretrained(str(stage2)).config.hidden_size == 32
    vecs = CPDAE.from_pretrained(str(stage2)).encode_docs(["a scientific claim about cells"])
    assert vecs.shape == (1, 32)


def test_decoder_from_refuses_what_does_not_fit(tmp_path, tiny_bert_dir, enwiki_dir):
    cache = tmp_path / "cache"
    stage1 = tmp_path / "stage1"
    cli.main(_common("cpdae") + ["--model", tiny_bert_dir, "--corpus", f"wiki:{enwiki_dir}", "--max-docs", "10",
                                 "--output_dir", str(stage1), "--cache-dir", str(cache)])
    base = ["--model", str(stage1), "--corpus", f"wiki:{enwiki_dir}", "--max-docs", "10", "--cache-dir", str(cache)]
    with pytest.raises(ValueError, match="decoder modules \\['decoder'\\] of objective 'cpdae'; objective 'seed' needs"):
        cli.main(_common("seed") + base + ["--decoder-from", str(stage1), "--output_dir", str(tmp_path / "s")])
    with pytest.raises(ValueError, match="objective 'mlm' has no decoder"):
        cli.main(_common("mlm") + base + ["--decoder-from", str(stage1), "--output_dir", str(tmp_path / "m")])
    with pytest.raises(FileNotFoundError, match="no such directory"):
        cli.main(_common("cpdae") + base + ["--decoder-from", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "n")])
    # a cpdae_nocl decoder continues in cpdae (same decoder, other loss)
    cli.main(_common("cpdae_nocl") + base + ["--decoder-from", str(stage1), "--output_dir", str(tmp_path / "ok")])


@pytest.mark.parametrize("objective", ["bow", "cpdae", "seed", "retromae"])
def test_representation_mean_feeds_the_masked_mean(tiny_bert_dir, objective, tmp_path):
    """--representation mean: the objective reads the mean of the last layer over the real tokens
    (spied at the decoder / head input) and the export records it."""
    from tests.helpers.objectives import load_tiny
    from pretrain.objectives import build_objective

    model, tok, cfg = load_tiny(tiny_bert_dir, objective=objective, batch_size=2, representation="mean")
    obj = build_objective(objective, model, tok, cfg).eval()
    batch = obj.collate([tok("dense retrieval pre training", add_special_tokens=False)["input_ids"],
                         tok("a much longer second text with more words in it", add_special_tokens=False)["input_ids"]])
    seen = []
    if objective == "bow":
        orig = obj.vocabulary_logits
        obj.vocabulary_logits = lambda v: (seen.append(v.detach()), orig(v))[1]
    elif objective == "cpdae":
        obj.decoder.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    elif objective == "seed":
        obj.decoder.register_forward_hook(lambda m, args, out: seen.append(args[0][:, 0].detach()))
    else:
        obj.decoder.register_forward_hook(lambda m, args, out: seen.append(args[1][:, 0].detach()))
    with torch.no_grad():
        obj(batch)
        views = batch["masked_input_ids"].shape[1]
        ref = []
        for v in range(views):
            h = obj.mlm_model(input_ids=batch["masked_input_ids"][:, v], attention_mask=batch["attention_mask"],
                              output_hidden_states=True).hidden_states[-1]
            for b in range(2):
                n = int(batch["attention_mask"][b].sum())
                ref.append(h[b, :n].mean(0))  # every real token, [CLS] and [SEP] included, no padding
    torch.testing.assert_close(seen[0], torch.stack(ref), rtol=1e-5, atol=1e-5)
    obj.save_pretrained(str(tmp_path / "m"))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["pooling"] == "mean"
    # the sentence-transformers description and CPDAE's loader pool as the model was trained
    assert json.loads((tmp_path / "m" / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    from pyterrier_cpdae import CPDAE
    assert CPDAE.from_pretrained(str(tmp_path / "m")).pooling == "mean"
    if objective != "bow":  # (bow has no decoder)
        assert json.loads((tmp_path / "m" / "decoder" / "decoder_config.json").read_text())["representation"] == "mean"
