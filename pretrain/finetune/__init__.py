"""Fine-tuning a pre-trained encoder as a bi-encoder with sentence-transformers: ``python -m pretrain finetune``."""
