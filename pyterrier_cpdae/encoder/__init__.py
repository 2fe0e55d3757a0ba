"""The encoder wing: :class:`CPDAE`, the PyTerrier transformer that turns texts into vectors.

* :mod:`~pyterrier_cpdae.encoder.cpdae`: :class:`CPDAE` (``encode_queries/encode_docs``, windows and batches, its
  backend chosen once, its identity);
* :mod:`~pyterrier_cpdae.encoder.options`: :class:`EncoderOptions`, the encoder's keywords in four groups;
* :mod:`~pyterrier_cpdae.encoder.stages`: its PyTerrier stages (``query_encoder()``, ``doc_encoder()``,
  ``text_scorer()``);
* :mod:`~pyterrier_cpdae.encoder.policy`: the automatic dtype and backend;
* :mod:`~pyterrier_cpdae.encoder.attention`: the variable-length attention function and its kernels (shared with
  ``pretrain``'s ``--unpad``);
* :mod:`~pyterrier_cpdae.encoder.backends`: the backends, one module each (``torch``, ``torch-unpadded``,
  ``openvino``), and ``choose_backend``, which picks one and says why;
* :mod:`~pyterrier_cpdae.encoder.identity`: the encoder's identity digest and the weights' digests;
* :mod:`~pyterrier_cpdae.encoder.first_token`: the last layer computed at ``[CLS]`` only;
* :mod:`~pyterrier_cpdae.encoder.loading`: loading a Hugging Face encoder and tokenizer (no pooler, checked weights);
* :mod:`~pyterrier_cpdae.encoder.batching`: text checks, de-duplication and length-sorted batches;
* :mod:`~pyterrier_cpdae.encoder.pooling`: ``cls`` / ``mean`` pooling (shared with ``pretrain``);
* :mod:`~pyterrier_cpdae.encoder.st_export`: the sentence-transformers files of an exported model.

Names are imported lazily, so that ``pretrain`` can use :mod:`~pyterrier_cpdae.encoder.pooling` without importing
PyTerrier.
"""
from __future__ import annotations


from pyterrier_cpdae._lazy import lazy_exports

_EXPORTS = {"CPDAE": "pyterrier_cpdae.encoder.cpdae"}
_EXPORTS.update({name: "pyterrier_cpdae.encoder.policy" for name in (
    "default_dtype", "cpu_has_native_bf16", "BACKENDS", "BACKEND_ENV", "DTYPE_ENV", "OPENVINO_MIN_TOKENS")})
_EXPORTS["openvino_available"] = "pyterrier_cpdae.encoder.backends.openvino"
_EXPORTS["EncoderOptions"] = "pyterrier_cpdae.encoder.options"

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports('pyterrier_cpdae.encoder', _EXPORTS, globals())
