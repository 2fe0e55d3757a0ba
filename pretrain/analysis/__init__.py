"""Looking into pre-trained models: ``python -m pretrain inspect`` and ``python -m pretrain coverage``.

* :mod:`pretrain.analysis.inspect_decoder`: the words a pre-trained decoder predicts from [CLS] vectors;
* :mod:`pretrain.analysis.coverage`: input-token coverage of [CLS] vectors projected onto the vocabulary.
"""
