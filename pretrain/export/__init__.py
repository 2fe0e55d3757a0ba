"""What an export holds besides what transformers writes: its model card and the weights it carries from its base.

* :mod:`~pretrain.export.card`: ``README.md`` (Hugging Face front matter + the run's description) and
  ``model_card.json`` (the record it is rendered from, the sessions, the evaluations); :func:`add_evaluation` is
  the entry point for whoever evaluates an export (the paper pipeline);
* :mod:`~pretrain.export.record`: what the run recorded, gathered for the card (never typed by hand);
* :mod:`~pretrain.export.markdown`: the card's text escaped for Markdown and HTML, without absolute paths;
* :mod:`~pretrain.export.weights`: the base model's pooler, carried into pre-training and fine-tuning exports.
"""
from .card import CARD, CARD_STATE, add_evaluation, front_matter, markdown_table, read_card_state, render, write_card

__all__ = ["CARD", "CARD_STATE", "add_evaluation", "front_matter", "markdown_table", "read_card_state", "render",
           "write_card"]
