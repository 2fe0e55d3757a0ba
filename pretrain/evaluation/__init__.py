"""Evaluation during training: the retrieval probe and its sentence-transformers evaluator (probe.py)."""
