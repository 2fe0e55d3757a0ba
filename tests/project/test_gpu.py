"""Real CUDA tests (``pytest -m gpu``; skipped without CUDA): the encoder, the streaming exact search, the
trainer and every pre-training objective on the device, each against an independent CPU/fp32 reference.

``CPDAE_GPU_TEST_DEVICE=cpu`` runs the same checks on the CPU (the CPU fallback of
``experiments/gpu/run_gpu_suite.sh --cpu-smoke``, run in CI by tests/experiments/gpu/test_gpu_packaging.py), so their logic is
exercised where no GPU is lent.  The model is a tiny random BERT with a synthetic vocabulary
(``experiments/gpu/synthetic_bert.py``): the GPU machine has no Hub and no MiniLM package.
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "gpu"))
from synthetic_bert import TINY, make_bert_dir, synthetic_texts  # noqa: E402

DEVICE = os.environ.get("CPDAE_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (CPDAE_GPU_TEST_DEVICE=cpu runs the same checks on the CPU)"),
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    return make_bert_dir(tmp_path_factory.mktemp("gpu-bert"), **TINY)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Texts of 3 to 60 word pieces (batches are padded: the masks matter)."""
    rng = np.random.default_rng(0)
    return [synthetic_texts(1, int(n), TINY["vocab_size"], seed=i)[0] for i, n in enumerate(rng.integers(3, 60, 24))]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# --------------------------------------------------------------------------------------------- encoder
def test_encoder_bf16_close_to_fp32_and_fp32_equal_to_sentence_transformers(bert_dir, texts):
    from sentence_transformers import SentenceTransformer

    from pyterrier_cpdae.encoder import CPDAE

    frame = pd.DataFrame({"docno": [str(i) for i in range(len(texts))], "text": texts})
    vecs = {}
    for dtype in ("float32", "bf16"):
        enc = CPDAE.from_pretrained(bert_dir, pooling="mean", doc_max_length=64, batch_size=8, device=DEVICE,
                                    dtype=dtype)
        vecs[dtype] = np.stack(enc.doc_encoder()(frame)["doc_vec"].tolist())
    # the independent reference: sentence-transformers' mean pooling, fp32, on the CPU
    st = SentenceTransformer(bert_dir, device="cpu")
    st.max_seq_length = 64
    ref = st.encode(texts, batch_size=8, convert_to_numpy=True)
    np.testing.assert_allclose(vecs["float32"], ref, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(vecs["bf16"], vecs["float32"])  # bf16 autocast really ran
    assert _cosines(vecs["bf16"], ref).min() > 0.999



def test_encoder_packed_batches_close_to_padded(bert_dir, texts, monkeypatch):
    """Unpadded batches through torch's varlen FlashAttention kernel (the default in bf16 on
    CUDA): vectors at cosine > 0.999 to the padded path's and to float32, each forward pass one row of real tokens
    within the token budget."""
    from pyterrier_cpdae.encoder import CPDAE
    from pyterrier_cpdae.encoder.backends import unpadded as unpadded_mod
    from pyterrier_cpdae.encoder.attention import reference_kernel, varlen_kernel

    if torch.device(DEVICE).type != "cuda":  # the CPU run of these checks: the text-by-text reference kernel
        monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: reference_kernel)
    elif varlen_kernel(torch.device(DEVICE), torch.bfloat16) is None:
        pytest.skip(f"torch's varlen_attn does not run on {DEVICE} in bf16: the encoder keeps padded batches")
    packed = CPDAE.from_pretrained(bert_dir, pooling="mean", doc_max_length=64, batch_size=8, device=DEVICE,
                                   dtype="bf16", unpad=True, batch_tokens=200)
    shapes = []
    packed.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    common = dict(pooling="mean", doc_max_length=64, batch_size=8)
    a = packed.encode_docs(texts)
    assert shapes and all(rows == 1 and width <= 200 for rows, width in shapes)
    b = CPDAE(packed.model, packed.tokenizer, dtype="bf16", unpad=False, batch_tokens=0, **common).encode_docs(texts)
    c = CPDAE(packed.model, packed.tokenizer, dtype="float32", **common).encode_docs(texts)
    assert _cosines(a, b).min() > 0.999 and _cosines(a, c).min() > 0.999


def test_batches_are_queued_without_waiting_for_the_device(bert_dir, texts):
    """A packed batch (ids, positions and bounds sent in one copy, the outputs re-laid by index and pooled) and a
    padded one (its attention mask made on the host) make no call that waits for the device (torch's sync debug
    mode in "error"), so the host prepares the next batch while the device runs this one; the vectors equal the
    encoder's (cosine > 0.999)."""
    from pyterrier_cpdae.encoder import CPDAE
    from pyterrier_cpdae.encoder.attention import reference_kernel, varlen_kernel
    from pyterrier_cpdae.encoder.backends.unpadded import packed_forward
    from pyterrier_cpdae.encoder.pooling import pool

    cuda = torch.device(DEVICE).type == "cuda"
    # the CPU run of these checks: the reference kernel and the vectors only (the CPU has no queue to wait for)
    kernel = varlen_kernel(torch.device(DEVICE), torch.bfloat16) if cuda else reference_kernel
    if kernel is None:
        pytest.skip(f"torch's varlen_attn does not run on {DEVICE} in bf16")
    enc = CPDAE.from_pretrained(bert_dir, pooling="mean", doc_max_length=64, device=DEVICE, dtype="bf16",
                                unpad=False, batch_tokens=0)
    ids = enc.tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    lengths = np.array([len(x) for x in ids])
    with enc._inference() as model:
        packed_forward(model, ids, lengths, enc.device, kernel)  # warm-up: handles, allocator blocks
        enc._padded_forward(model, ids, lengths, enc.tokenizer.pad_token_id)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            hidden, mask = packed_forward(model, ids, lengths, enc.device, kernel)
            vecs = pool(hidden, mask, "mean")
            hidden, mask = enc._padded_forward(model, ids, lengths, enc.tokenizer.pad_token_id)
            padded_vecs = pool(hidden, mask, "mean")
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    reference = enc.encode_docs(texts)
    assert _cosines(vecs.cpu().numpy(), reference).min() > 0.999
    assert _cosines(padded_vecs.cpu().numpy(), reference).min() > 0.999


# --------------------------------------------------------------------------------------------- search
N_DOCS, DIM_SEARCH, K_SEARCH = 3000, 16, 100


@pytest.fixture
def staged_search(tmp_path, monkeypatch):
    """A 3,000-document index, 40 topics, the numpy reference ranking, and the blocks the torch kernel stages."""
    from tests.helpers.dense import make_docs, make_topics

    from pyterrier_cpdae.dense import kernels as _exact_search
    from pyterrier_cpdae.dense import DenseIndex

    docs, _ = make_docs(N_DOCS, DIM_SEARCH)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(40, DIM_SEARCH)
    staged = []
    send = _exact_search._ChunkStager.send

    def spy(self, block):
        out = send(self, block)
        staged.append((type(block).__name__, len(block), out.device.type))
        return out
    monkeypatch.setattr(_exact_search._ChunkStager, "send", spy)
    ref = index.np_retriever(num_results=K_SEARCH, block_size=512)(topics)
    return index, topics, staged, ref


def _same_ranking(got, ref):
    for qid in ref["qid"].unique():
        a, b = got[got["qid"] == qid], ref[ref["qid"] == qid]
        assert list(a["docno"]) == list(b["docno"]) and list(a["rank"]) == list(b["rank"])
        np.testing.assert_allclose(a["score"].to_numpy(), b["score"].to_numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_torch_retriever_streams_chunks_through_the_device_and_ranks_like_numpy(staged_search, precision):
    index, topics, staged, ref = staged_search
    chunk = 256
    got = index.torch_retriever(num_results=K_SEARCH, device=DEVICE, chunk_size=chunk, resident=False,
                                precision=precision)(topics)
    # the index went through the device in chunks smaller than the index (streaming), all of it once
    assert [n for _, n, _ in staged] == [min(chunk, N_DOCS - s) for s in range(0, N_DOCS, chunk)]
    assert "Tensor" not in {kind for kind, _, _ in staged}  # host arrays, staged
    assert {d for _, _, d in staged} == {torch.device(DEVICE).type}
    _same_ranking(got, ref)


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_torch_retriever_holds_a_fitting_index_on_the_device_and_ranks_like_numpy(staged_search, precision):
    index, topics, staged, ref = staged_search
    # default on CUDA: a small index is held on the device (on the CPU test device: asked for explicitly)
    retr = index.torch_retriever(num_results=K_SEARCH, device=DEVICE, resident=None if DEVICE == "cuda" else True,
                                 precision=precision)
    got, again = retr(topics), retr(topics)
    assert staged == []  # nothing sent: the chunks are slices of the copy held on the device
    (held,) = index.store.device_parts(DEVICE)
    assert held[0].device.type == torch.device(DEVICE).type and len(held[0]) == N_DOCS
    assert index.store.device_parts(DEVICE)[0][0] is held[0]  # loaded once, kept for the next searches
    _same_ranking(got, ref)
    _same_ranking(again, ref)


def test_torch_retriever_streams_a_pinned_host_copy_and_ranks_like_numpy(staged_search, monkeypatch):
    """``pinned=True``: a streamed index is sent from a page-locked host copy made once (no host copy per chunk),
    and ranks as numpy does, twice."""
    from pyterrier_cpdae.dense import store as store_mod

    index, topics, staged, ref = staged_search
    cuda = torch.device(DEVICE).type == "cuda"
    if not cuda:  # the CPU run: ordinary memory stands in for page-locked memory (torch locks it for CUDA only)
        monkeypatch.setattr(store_mod, "_empty", lambda shape, dtype, device, pinned: torch.empty(shape, dtype=dtype))
    retr = index.torch_retriever(num_results=K_SEARCH, device=DEVICE, chunk_size=700, resident=False, pinned=True)
    got, again = retr(topics), retr(topics)
    (part,) = index.store.pinned_parts()
    assert index.store.pinned_parts()[0][0] is part[0] and part[0].device.type == "cpu"  # made once, kept
    np.testing.assert_array_equal(part[0].numpy(), index.store.open()[1][0][0])
    if cuda:
        assert part[0].is_pinned()
        assert {kind for kind, _, _ in staged} == {"Tensor"} and {d for _, _, d in staged} == {"cuda"}
        assert sum(n for _, n, _ in staged) == 2 * N_DOCS  # each search sent the whole index from the pinned copy
    _same_ranking(got, ref)
    _same_ranking(again, ref)


def test_a_streamed_search_sends_a_page_locked_copy_by_default(staged_search, monkeypatch):
    """``pinned=None`` (the default): a streamed CUDA search whose vectors fit in a quarter of the available host
    memory makes the page-locked copy by itself (``pin_on_host``) and sends every chunk from it; on the CPU it never
    does. Both rank as numpy does."""
    index, topics, staged, ref = staged_search
    cuda = torch.device(DEVICE).type == "cuda"
    retr = index.torch_retriever(num_results=K_SEARCH, device=DEVICE, chunk_size=700, resident=False)
    got = retr(topics)
    assert index.store.holds_pinned_copy() == cuda
    if cuda:
        (part,) = index.store.pinned_parts()
        assert part[0].is_pinned() and {kind for kind, _, _ in staged} == {"Tensor"}
    _same_ranking(got, ref)


@pytest.mark.parametrize("name", ["mlm", "cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec", "seed", "retromae", "bow"])
def test_objective_loss_and_gradients_on_the_device_equal_cpu(name, bert_dir, texts, monkeypatch):
    from transformers import AutoTokenizer

    from pretrain.objectives import retromae
    from tests.helpers.objectives import make

    # RetroMAE draws its decoder masks inside forward, on the device: draw them on the CPU for both runs
    draw = retromae.retromae_decoder_mask

    def cpu_mask(am, special, ratio, generator=None, row_seeds=None, size=None):
        if row_seeds is not None:  # the collator's per-text seeds: each text's draw, on the CPU
            return draw(am.cpu(), special.cpu(), ratio, row_seeds=row_seeds.cpu(), size=size).to(am.device)
        g = torch.Generator().manual_seed(7)
        return draw(am.cpu(), special.cpu(), ratio, generator=g).to(am.device)
    monkeypatch.setattr(retromae, "retromae_decoder_mask", cpu_mask)

    tok = AutoTokenizer.from_pretrained(bert_dir)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:8]]
    extra = {"idf": torch.rand(TINY["vocab_size"], generator=torch.Generator().manual_seed(3)) + 0.5} \
        if name == "cpdae_idfrec" else {}
    cpu_obj = make(name, bert_dir, tok, batch_size=8, **extra).eval()  # eval: no dropout
    dev_obj = copy.deepcopy(cpu_obj).to(DEVICE)
    batch = cpu_obj.collate(examples)
    outs, grads = {}, {}
    for where, obj in (("cpu", cpu_obj), ("device", dev_obj)):
        out = obj({k: v.to(next(obj.parameters()).device) for k, v in batch.items()})
        out["loss"].backward()
        outs[where] = {k: float(v.detach()) for k, v in out.flat().items() if torch.is_tensor(v) and v.dim() == 0}
        grads[where] = {n: p.grad.detach().cpu() for n, p in obj.named_parameters() if p.grad is not None}
    assert outs["cpu"].keys() == outs["device"].keys() and "loss" in outs["cpu"]
    for key, value in outs["cpu"].items():
        assert outs["device"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert grads["cpu"].keys() == grads["device"].keys() and grads["cpu"]
    for key, g in grads["cpu"].items():
        torch.testing.assert_close(grads["device"][key], g, rtol=1e-3, atol=1e-5, msg=key)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mlm", "cpdae"])  # every objective unpadded on CUDA: the test above (auto)
def test_objective_unpadded_equals_padded_on_the_device(name, precision, bert_dir, texts):
    """``--unpad on`` (the device's varlen kernel: FlashAttention-2 or nested-tensor SDPA on CUDA) against ``off`` on
    the same device: fp32 to 1e-4 relative; under bf16 autocast the loss to 2e-2 relative and every gradient to 5e-2
    in relative L2 norm (bf16 rounds the two paths' differently shaped matmuls differently), the attention's key bias
    aside (its exact gradient is 0; both paths give rounding noise)."""
    from transformers import AutoTokenizer

    from tests.helpers.objectives import make

    tok = AutoTokenizer.from_pretrained(bert_dir)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:8]]
    objs = {mode: make(name, bert_dir, tok, batch_size=8, unpad=mode).eval().to(DEVICE) for mode in ("off", "on")}
    batch = objs["on"].collate(examples)  # with the packed rows laid out on the host (the padded path ignores them)
    assert any(k.startswith("packed_") for k in batch)
    outs, grads = {}, {}
    for mode, obj in objs.items():
        with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = obj({k: v.to(DEVICE) for k, v in batch.items()})
        out["loss"].backward()
        outs[mode] = {k: float(v.detach()) for k, v in out.flat().items() if torch.is_tensor(v) and v.dim() == 0}
        grads[mode] = {n: p.grad.detach().float().cpu() for n, p in obj.named_parameters() if p.grad is not None}
    rel = 1e-4 if precision == "fp32" else 2e-2
    for key, value in outs["off"].items():
        assert outs["on"][key] == pytest.approx(value, rel=rel, abs=1e-5), (key, outs)
    assert grads["off"].keys() == grads["on"].keys() and grads["off"]
    for key, g in grads["off"].items():
        if precision == "fp32":
            torch.testing.assert_close(grads["on"][key], g, rtol=1e-3, atol=1e-5, msg=key)
        elif not key.endswith("attention.self.key.bias"):  # its exact gradient is 0 (softmax ignores a shift of
            err = float((grads["on"][key] - g).norm() / g.norm().clamp_min(1e-12))  # a row's scores): bf16 noise
            assert err < 5e-2, (key, err)


@pytest.mark.parametrize("name", ["mlm", "cpdae"])
def test_a_packed_training_step_does_not_wait_for_the_device(name, bert_dir, texts):
    """Packed rows (``--unpad on``: the collate's host layout, copied from pinned memory without blocking): a training
    step's forward and backward under bf16 autocast, dropout on, is queued without one synchronisation (CUDA's sync
    debug mode "error": a value read back, a blocking copy or a ``nonzero`` raises). The CPU run of this check (no
    queue to wait for) runs the same step and checks its loss and gradients are finite."""
    from transformers import AutoTokenizer

    from tests.helpers.objectives import make

    tok = AutoTokenizer.from_pretrained(bert_dir)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:8]]
    obj = make(name, bert_dir, tok, batch_size=8, unpad="on").train().to(DEVICE)
    cuda = torch.device(DEVICE).type == "cuda"
    host = {k: v.pin_memory() if cuda else v for k, v in obj.collate(examples).items()}  # as the DataLoader pins
    assert any(k.startswith("packed_") for k in host)

    def step() -> torch.Tensor:
        batch = {k: v.to(DEVICE, non_blocking=True) for k, v in host.items()}
        with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = obj(batch)["loss"]
        loss.backward()
        return loss.detach()

    step()  # warm-up: handles, allocator blocks, the kernels' first calls
    obj.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in obj.parameters() if p.grad is not None)


# --------------------------------------------------------------------------------------------- FAISS GPU
def test_faiss_gpu_flat_matches_exact_search(tmp_path):
    faiss = pytest.importorskip("faiss")
    if DEVICE != "cuda" or not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        pytest.skip("faiss-gpu is not installed or sees no GPU")
    from tests.helpers.dense import make_docs, make_topics

    from pyterrier_cpdae.dense import DenseIndex

    docs, _ = make_docs(5000, 32)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(20, 32)
    retriever = index.faiss_flat_retriever(num_results=50, use_gpu=True)
    got = retriever(topics)
    assert retriever._on_gpu(faiss) and type(retriever.faiss_index()).__name__ != "IndexFlatIP"  # not the CPU index
    ref = index.np_retriever(num_results=50)(topics)
    assert list(got["docno"]) == list(ref["docno"])
