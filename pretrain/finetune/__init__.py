"""Fine-tuning a pre-trained encoder as a bi-encoder with sentence-transformers: ``python -m pretrain finetune``.

* :mod:`pretrain.finetune.train`: the command, its mining rounds, the model, the loss and the trainer;
* :mod:`pretrain.finetune.arguments`: its options (``FinetuneArguments`` + ``SentenceTransformerTrainingArguments``);
* :mod:`pretrain.finetune.negatives`: training groups and hard negatives (BM25, a file, a dense model).
"""
