/*
 * pyterrier-cpdae: feeds documents to Anserini's SimpleIndexer without JSON and without stalls.
 *
 * Python sends a batch as one byte[]: the UTF-8 encoding of "docno\0text\0docno\0text..." (NUL separates
 * fields: BM25Indexer rejects it in docnos and texts). addBlob() checks and splits the batch, queues it as
 * chunks and returns; a fixed set of indexing threads takes chunks from the queue, decodes each docno and text
 * into Java strings and hands them to SimpleIndexer.addJsonDocument. Python prepares the next batch meanwhile,
 * and the threads never wait for it as long as the queue holds work. finish() waits for the queue to drain,
 * then has every thread write one of the in-memory buffers as a segment at the same time (the commit in
 * SimpleIndexer.close() would otherwise write them one after another in one thread), and commits.
 *
 * The Lucene documents are the ones `python -m pyserini.index.lucene --collection JsonCollection` builds: the
 * same DefaultLuceneDocumentGenerator (configured by SimpleIndexer's IndexCollection arguments) turns each
 * document into its id / contents fields. What this class saves is the JSON round trip (Python's json.dumps,
 * Jackson's parse, and JsonCollection.Document's pretty-printed copy of every document, its raw(), which the
 * generator reads only under -storeRaw, which BM25Indexer never passes) and the per-call thread pool of
 * SimpleIndexer.addRawDocuments.
 *
 * Rebuild the jar after editing this file: python -m pyterrier_cpdae.java.build
 */
package pyterrier_cpdae;

import io.anserini.collection.JsonCollection;
import io.anserini.index.SimpleIndexer;
import org.apache.lucene.index.IndexWriter;

import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.Collections;
import java.util.Map;
import java.util.concurrent.ArrayBlockingQueue;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

public final class BlobIndexer implements AutoCloseable {
  /** A JsonCollection document that holds its id and contents directly (no JSON tree, no raw copy). */
  static final class PlainDocument extends JsonCollection.Document {
    private final String id;
    private final String contents;

    PlainDocument(String id, String contents) {
      this.id = id;
      this.contents = contents;
    }

    @Override public String id() { return id; }
    @Override public String contents() { return contents; }
    @Override public String raw() { throw new UnsupportedOperationException("BlobIndexer documents have no raw JSON (-storeRaw)"); }
    @Override public boolean indexable() { return true; }
    @Override public Map<String, String> fields() { return Collections.emptyMap(); }
  }

  /** Documents [from, to) of one batch. */
  private record Chunk(byte[] blob, int[] starts, int from, int to) {}

  private static final Chunk END = new Chunk(new byte[0], new int[0], 0, 0);

  private final SimpleIndexer indexer;
  private final IndexWriter writer;  // SimpleIndexer's own (for the parallel flush); null where it cannot be reached
  private final int threads;
  private final BlockingQueue<Chunk> queue;
  private final Thread[] workers;
  private final AtomicLong added = new AtomicLong();
  private final AtomicReference<String> firstRefused = new AtomicReference<>();
  private final AtomicReference<Throwable> error = new AtomicReference<>();
  private volatile boolean stopping = false;
  private boolean finished = false;

  public BlobIndexer(SimpleIndexer indexer, int threads) {
    if (threads < 1) {
      throw new IllegalArgumentException("threads must be >= 1, got " + threads);
    }
    this.indexer = indexer;
    this.writer = writerOf(indexer);
    this.threads = threads;
    this.queue = new ArrayBlockingQueue<>(2 * threads);  // a batch in the threads' hands and one waiting
    this.workers = new Thread[threads];
    for (int t = 0; t < threads; t++) {
      workers[t] = new Thread(this::work, "pyterrier-cpdae-bm25-" + (t + 1));
      workers[t].setDaemon(true);
      workers[t].start();
    }
  }

  private void work() {
    while (true) {
      Chunk chunk;
      try {
        chunk = queue.take();
      } catch (InterruptedException e) {
        return;
      }
      if (chunk == END) {
        return;
      }
      if (stopping || error.get() != null) {
        continue;  // drain: a failed or abandoned build indexes nothing more
      }
      try {
        for (int d = chunk.from; d < chunk.to && !stopping; d++) {
          String id = field(chunk.blob, chunk.starts, 2 * d);
          String text = field(chunk.blob, chunk.starts, 2 * d + 1);
          if (indexer.addJsonDocument(new PlainDocument(id, text))) {
            added.incrementAndGet();
          } else {
            firstRefused.compareAndSet(null, id);
          }
        }
      } catch (Throwable t) {
        error.compareAndSet(null, t);
      }
    }
  }

  private static String field(byte[] blob, int[] starts, int k) {
    return new String(blob, starts[k], starts[k + 1] - 1 - starts[k], StandardCharsets.UTF_8);
  }

  /** Where each of the 2 * count NUL-separated fields of the blob starts (and, last, one past its end). */
  static int[] fieldStarts(byte[] blob, int count) {
    if (count < 1) {
      throw new IllegalArgumentException("a batch needs at least one document, got count=" + count);
    }
    final int[] starts = new int[2 * count + 1];
    int field = 0;
    for (int i = 0; i < blob.length; i++) {
      if (blob[i] == 0) {
        if (field + 1 >= 2 * count) {
          throw new IllegalArgumentException("batch holds more than " + (2 * count) + " fields");
        }
        starts[++field] = i + 1;
      }
    }
    if (field != 2 * count - 1) {
      throw new IllegalArgumentException("batch holds " + (field + 1) + " fields, expected " + (2 * count));
    }
    starts[2 * count] = blob.length + 1;  // the end of the last field, as if a separator followed it
    return starts;
  }

  /** Throws {@code t} (an Error wrapped in a RuntimeException) if it is not null. */
  private static void rethrow(Throwable t) throws Exception {
    if (t instanceof Exception e) {
      throw e;
    }
    if (t != null) {
      throw new RuntimeException(t);
    }
  }

  /**
   * Queues the {@code count} documents of {@code blob} for indexing; blocks only while the queue is full.
   *
   * @throws IllegalArgumentException if the blob does not hold exactly 2 * count NUL-separated fields
   * @throws Exception the failure of an indexing thread on an earlier batch
   */
  public void addBlob(byte[] blob, int count) throws Exception {
    if (finished) {
      throw new IllegalStateException("finish() was called: no more batches");
    }
    rethrow(error.get());
    final int[] starts = fieldStarts(blob, count);
    final int per = Math.max(1, (count + threads - 1) / threads);  // one chunk per thread
    for (int from = 0; from < count; from += per) {
      queue.put(new Chunk(blob, starts, from, Math.min(count, from + per)));
    }
  }

  /**
   * Waits until every queued document is indexed, writes the in-memory buffers as segments with all threads at
   * once and commits; returns the number of documents Lucene accepted.
   *
   * @throws Exception the failure of an indexing thread, of the flush or of the commit (SimpleIndexer.close()
   *     would only log a failed commit)
   */
  public long finish() throws Exception {
    if (!finished) {
      finished = true;
      for (int t = 0; t < threads; t++) {
        queue.put(END);
      }
      for (Thread w : workers) {
        w.join();
      }
      rethrow(error.get());
      flush();
      if (writer != null) {
        writer.commit();
      }
    }
    return added.get();
  }

  /** The docno of the first document Lucene refused (its reason is in the Java log), or null. */
  public String firstRefused() {
    return firstRefused.get();
  }

  /** SimpleIndexer's private IndexWriter (it has no getter), or null if this Anserini version has none. */
  static IndexWriter writerOf(SimpleIndexer indexer) {
    try {
      Field field = SimpleIndexer.class.getDeclaredField("writer");
      field.setAccessible(true);
      return field.get(indexer) instanceof IndexWriter w ? w : null;
    } catch (ReflectiveOperationException | RuntimeException e) {
      return null;
    }
  }

  /** Whether {@link #flush()} reaches the IndexWriter (else it does nothing and the commit flushes). */
  public boolean canFlush() {
    return writer != null;
  }

  /**
   * Writes the documents buffered in memory as segments, {@code threads} threads each flushing one buffer at a
   * time; returns the number of segments written. The segments are the same as the commit would write.
   */
  public int flush() throws Exception {
    if (writer == null) {
      return 0;
    }
    final AtomicInteger flushed = new AtomicInteger();
    final AtomicReference<Throwable> failure = new AtomicReference<>();
    Thread[] flushers = new Thread[threads];
    for (int t = 0; t < threads; t++) {
      flushers[t] = new Thread(() -> {
        try {
          while (writer.flushNextBuffer()) {
            flushed.incrementAndGet();
          }
        } catch (Throwable e) {
          failure.compareAndSet(null, e);
        }
      }, "pyterrier-cpdae-bm25-flush-" + (t + 1));
      flushers[t].start();
    }
    for (Thread f : flushers) {
      f.join();
    }
    rethrow(failure.get());
    return flushed.get();
  }

  /**
   * Stops the indexing threads; after a failure, documents still queued are dropped (a build that succeeds
   * calls finish() first). No thread is interrupted: Lucene treats an interrupted write as a tragedy.
   */
  @Override
  public void close() throws InterruptedException {
    stopping = true;
    queue.clear();
    for (int t = 0; t < threads; t++) {
      queue.offer(END);  // room: the queue was just emptied and only this thread adds to it now
    }
    for (Thread w : workers) {
      w.join();
    }
  }
}
