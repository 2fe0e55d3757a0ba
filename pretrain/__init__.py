"""Pre-training toolkit of pyterrier-cpdae (``python -m pretrain``).

Importing the package registers its Hugging Face model parts with transformers' ``AutoConfig`` / ``AutoModel``
(:mod:`pretrain.model.modeling`: the CPDAE decoder and the other objectives' heads), so that
``transformers.AutoModel.from_pretrained("<run>/decoder")`` loads a run's decoder without ``trust_remote_code``.
"""
from .model import modeling  # noqa: F401  (registers the decoder model types)
