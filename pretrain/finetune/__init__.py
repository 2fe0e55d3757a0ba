"""Fine-tuning a pre-trained encoder as a bi-encoder: ``python -m pretrain finetune``.

* :mod:`pretrain.finetune.train`: the command (``main``), its rounds of hard-negative mining and the training run;
* :mod:`pretrain.finetune.biencoder`: the shared-weight query/document encoder and its losses;
* :mod:`pretrain.finetune.negatives`: training triples and hard negatives (BM25, a file, a dense model).

Options: :class:`pretrain.config.FinetuneConfig`.  The training loop is the pre-training one
(:class:`pretrain.training.trainer.Trainer`).
"""
