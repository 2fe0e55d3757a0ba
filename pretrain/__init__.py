"""Pre-training toolkit of pyterrier-cpdae (``python -m pretrain``). Importing it registers the decoder and head
model types with transformers' auto classes: ``AutoModel.from_pretrained("<run>/decoder")`` loads a run's decoder."""
from .model import modeling  # noqa: F401  (registers the decoder model types)
