"""Evaluation during training: :mod:`pretrain.evaluation.probe` (the retrieval probe and its sentence-transformers
evaluator)."""
