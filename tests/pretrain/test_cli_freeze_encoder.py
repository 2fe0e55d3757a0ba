"""``--freeze-encoder``: a head warm-up that leaves the encoder untouched (the new MLM head of MiniLM)."""
from __future__ import annotations

import pytest
import torch


def _corpus(path):
    words = "paris france capital river bridge music piano ocean whale coral desert camel sand physics energy".split()
    import random
    rng = random.Random(0)
    path.write_text("".join(" ".join(rng.choices(words, k=40)) + ".\n" for _ in range(24)))
    return str(path)


def _state(path):
    from pretrain.model.modeling import load_mlm_model
    m = load_mlm_model(path, new_mlm_head=False)  # an export's MLM head lies in mlm_head/
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_encoder_trains_only_the_head(tmp_path, tiny_bert_dir, freeze):
    from pretrain.cli import main

    out = tmp_path / "run"
    argv = ["--objective", "mlm", "--model", tiny_bert_dir, "--corpus", _corpus(tmp_path / "c.txt"),
            "--max-length", "32", "--global_batch_size", "4", "--max-steps", "3", "--learning-rate", "1e-2",
            "--warmup_steps", "0", "--save-steps", "1000", "--report_to", "none", "--output_dir", str(out), "--use_cpu"]
    main(argv + (["--freeze-encoder"] if freeze else []))
    before, after = _state(tiny_bert_dir), _state(str(out))
    enc = [k for k in before if k.startswith("bert.")]
    head = [k for k in before if k.startswith("cls.predictions.") and "decoder.weight" not in k]
    assert enc and head
    enc_changed = [k for k in enc if not torch.equal(before[k], after[k])]
    head_changed = [k for k in head if not torch.equal(before[k], after[k])]
    # the head's transform (dense, LayerNorm) and output bias train in both cases
    assert {"cls.predictions.transform.dense.weight", "cls.predictions.bias"} <= set(head_changed)
    if freeze:
        assert enc_changed == []   # every encoder tensor bit-identical, the (tied) word embeddings too
        assert torch.equal(after["cls.predictions.decoder.weight"], before["bert.embeddings.word_embeddings.weight"])
    else:                          # the reference: without the flag the same run moves the encoder
        assert "bert.encoder.layer.0.attention.self.query.weight" in enc_changed


def test_freeze_encoder_refuses_an_objective_with_nothing_else_to_train(tmp_path, tiny_bert_dir):
    from pretrain.cli import main

    with pytest.raises(ValueError, match="--freeze_encoder.*nothing would train"):
        main(["--objective", "simcse", "--model", tiny_bert_dir, "--corpus", _corpus(tmp_path / "c.txt"),
              "--max-length", "32", "--global_batch_size", "4", "--max-steps", "1", "--warmup_steps", "0", "--save-steps", "1000", "--report_to", "none",
              "--output_dir", str(tmp_path / "run"), "--use_cpu", "--freeze-encoder"])
