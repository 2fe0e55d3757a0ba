/*
 * pyterrier-cpdae: the results of Anserini's SimpleSearcher.batch_search as four flat arrays.
 *
 * batch_search returns a Map of ScoredDoc[]; reading three fields of every hit from Python costs one JNI call
 * each (about 2 s for 540 queries x 1000 hits). search() runs the same batch_search and copies the hits, in
 * query order, into arrays that pyjnius converts in one call each.
 *
 * Rebuild the jar after editing this file: python -m pyterrier_cpdae.java.build
 */
package pyterrier_cpdae;

import io.anserini.search.ScoredDoc;
import io.anserini.search.SimpleSearcher;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;

public final class FlatHits {
  /** Hits of each query, in the order of the queries. */
  public final int[] counts;
  /** The hits' docnos (Anserini's docid field), query after query, each query's hits best first. */
  public final String[] docnos;
  /** The hits' Lucene document numbers, aligned with docnos. */
  public final int[] docids;
  /** The hits' scores as SimpleSearcher reports them, aligned with docnos. */
  public final float[] scores;

  private FlatHits(int[] counts, String[] docnos, int[] docids, float[] scores) {
    this.counts = counts;
    this.docnos = docnos;
    this.docids = docids;
    this.scores = scores;
  }

  /** SimpleSearcher.batch_search(queries, k, threads), flattened into query order. */
  public static FlatHits search(SimpleSearcher searcher, String[] queries, int k, int threads) {
    List<String> keys = new ArrayList<>(queries.length);
    for (int i = 0; i < queries.length; i++) {
      keys.add(Integer.toString(i));  // positional keys: the caller's qids may repeat
    }
    Map<String, ScoredDoc[]> hits = searcher.batch_search(Arrays.asList(queries), keys, k, threads);
    int[] counts = new int[queries.length];
    int total = 0;
    for (int i = 0; i < queries.length; i++) {
      ScoredDoc[] found = hits.get(keys.get(i));
      counts[i] = found == null ? 0 : found.length;
      total += counts[i];
    }
    String[] docnos = new String[total];
    int[] docids = new int[total];
    float[] scores = new float[total];
    int at = 0;
    for (int i = 0; i < queries.length; i++) {
      ScoredDoc[] found = hits.get(keys.get(i));
      for (int j = 0; j < counts[i]; j++, at++) {
        docnos[at] = found[j].docid;
        docids[at] = found[j].lucene_docid;
        scores[at] = found[j].score;
      }
    }
    return new FlatHits(counts, docnos, docids, scores);
  }
}
