/*
 * Paged attention for decoding sequences (one new query token each), on the CPU.
 *
 * Tasks run in parallel: a sequence each (a chunk of CHUNK_KEYS keys of a longer one, of fewer in
 * a small batch, the chunks merged afterwards) when there are enough of them to keep every thread
 * busy, else one (chunk, kv head) pair. A task walks the sequence's blocks through its block
 * table and reads keys and values in place (no gather copy): scores of every query head, a
 * softmax, then the values, each cache row read from memory once, which is what bounds a decode
 * step. With AVX-512 (attend_avx512) or AVX2 (attend_avx2) keys and values go 16 tokens at a
 * time, every query head of the task is served from each tile's rows, and the rows of the chunk a
 * thread runs next are requested while it computes the current one; elsewhere a portable loop
 * (attend_one) does the same work head by head. fp32 and bf16 caches; bf16 is widened to fp32
 * for the arithmetic. An fp8 cache (kv_cache_dtype, e4m3fn or e5m2) under fp32 or bf16 queries
 * is named in bits 4-7 of the dtype argument (0 there: the queries' dtype) and widened exactly as
 * it is read: e5m2 is the high byte of an fp16, e4m3fn's magnitude shifted into an fp16 is its
 * value times 2^-8 (subnormals included); their NaN and inf codes read as NaN and inf, as torch
 * reads them (the cache holds none: write_kv saturates); on the vector paths a tile's fp8 keys
 * are widened once per kv head, into the queries' dtype with AVX-512 (stage_keys), into fp32
 * with AVX2 (stage_keys_8). Any other dtype argument is refused.
 *
 * Layouts (row-major): q and out (num_seqs, num_heads, head_dim); k_cache and v_cache
 * (num_blocks, block_size, num_kv_heads, head_dim); block_tables (num_seqs, max_blocks) int64;
 * seq_lens (num_seqs,) int64. Query head h uses kv head h / (num_heads / num_kv_heads).
 * window > 0 limits each query to its `window` most recent keys (itself included). softcap > 0
 * (Gemma 2) turns each scaled score s into softcap * tanh(s / softcap) before the softmax; that pass
 * runs only then, over the stored scores, so the kernels without it do what they did before.
 * sinks (gpt-oss; NULL for the others): one logit per query head that joins each softmax's
 * denominator (exp(sink - max) added to the sum) and takes no value; it too applies only where
 * given, when the softmax is normalised (write_heads, and the prefill task's last pass).
 *
 * Built with -ffast-math for vectorised expf and reductions, but linked without it, so the
 * library does not switch the process to flush-to-zero when it is loaded. head_dim 64, 128 and
 * 256 get specialised copies (fully unrolled inner loops).
 *
 * Prefill attention (many new query tokens per sequence, paged_prefill_attention) follows below.
 */
#include "common.h"

/* Element `index` of a cache of dtype `kv` (kv_dtype_of's) as fp32. */
static inline float cache_value(const void *base, int64_t index, int kv) {
    if (kv == DTYPE_F32) return ((const float *)base)[index];
    if (kv == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[index]);
    const uint32_t b = ((const uint8_t *)base)[index], sign = (b & 0x80u) << 24;
    const int mantissa_bits = kv == KV_DTYPE_E5M2 ? 2 : 3, bias = kv == KV_DTYPE_E5M2 ? 15 : 7;
    const uint32_t exponent = (b & 0x7Fu) >> mantissa_bits, mantissa = b & ((1u << mantissa_bits) - 1u);
    union { uint32_t u; float f; } bits = {.u = sign};
    if (kv == KV_DTYPE_E5M2 && exponent == 31) {  /* inf (mantissa 0) or NaN, as in fp16 */
        bits.u |= 0x7F800000u | mantissa << 21;
        return bits.f;
    }
    if (kv == KV_DTYPE_E4M3 && exponent == 15 && mantissa == 7) {  /* e4m3fn's only NaN; no inf */
        bits.u |= 0x7FC00000u;
        return bits.f;
    }
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^(1 - bias - mantissa_bits) */
        const float magnitude = ldexpf((float)mantissa, 1 - bias - mantissa_bits);
        return sign ? -magnitude : magnitude;
    }
    bits.u |= (exponent - bias + 127u) << 23 | mantissa << (23 - mantissa_bits);
    return bits.f;
}

/* The fp8 cache row at `index` (kv: KV_DTYPE_*) widened into buffer: the dtype picked once per
 * row, not per element, so that the element loop stays a straight one. */
static inline const float *fp8_row_f32(const void *base, int64_t index, int64_t head_dim, int kv,
                                       float *buffer) {
    if (kv == KV_DTYPE_E5M2)
        for (int64_t d = 0; d < head_dim; d++) buffer[d] = cache_value(base, index + d, KV_DTYPE_E5M2);
    else
        for (int64_t d = 0; d < head_dim; d++) buffer[d] = cache_value(base, index + d, KV_DTYPE_E4M3);
    return buffer;
}

/* scores[0:n] = cap * tanh(scores / cap): Gemma 2's soft cap, on scores already scaled. */
static void soft_cap(float *scores, int64_t n, float cap) {
    const float inverse = 1.0f / cap;
    for (int64_t t = 0; t < n; t++) scores[t] = cap * tanhf(scores[t] * inverse);
}

/* Fixed-size fp32 copy of a head_dim row: the cache row itself (fp32) or a widened copy. */
static inline const float *row_f32(const void *base, int64_t index, int64_t head_dim, int dtype,
                                   float *buffer) {
    if (dtype == DTYPE_F32) return (const float *)base + index;
    const uint16_t *src = (const uint16_t *)base + index;
    for (int64_t d = 0; d < head_dim; d++) buffer[d] = bf16_to_f32(src[d]);
    return buffer;
}

static inline void prefetch_block(const void *cache, int64_t block, int64_t block_size,
                                  int64_t num_kv_heads, int64_t kv, int64_t head_dim,
                                  int64_t elem_size) {
    const char *base = (const char *)cache;
    const int64_t row_bytes = head_dim * elem_size;
    for (int64_t s = 0; s < block_size; s++) {
        const char *row = base + ((block * block_size + s) * num_kv_heads + kv) * row_bytes;
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
}

/* scale * (q . k) for bf16 rows. With AVX512-BF16, pairs of bf16 products accumulate straight
 * into fp32 (vdpbf16ps) from the unscaled bf16 query row; otherwise the key row is widened and
 * multiplied with the already-scaled fp32 query. */
static inline float dot_bf16(const void *q, int64_t q_index, const void *k_cache, int64_t k_index,
                             int64_t head_dim, float scale, const float *scaled_query) {
#if defined(__AVX512BF16__)
    if (head_dim % 32 == 0) {
        const uint16_t *qrow = (const uint16_t *)q + q_index;
        const uint16_t *krow = (const uint16_t *)k_cache + k_index;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qrow + d),
                                   (__m512bh)_mm512_loadu_si512(krow + d));
        return _mm512_reduce_add_ps(acc) * scale;
    }
#endif
    (void)q; (void)q_index; (void)scale;
    const uint16_t *k = (const uint16_t *)k_cache + k_index;
    float dot = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) dot += scaled_query[d] * bf16_to_f32(k[d]);
    return dot;
}

/* Calls BODY for each key position of the sequence with `index` = the element offset of kv head
 * `kv`'s row for that token, and `t` = 0, 1, ...; walks block by block (no division per key). */
#define FOR_EACH_KEY(CACHE, BODY)                                                             \
    for (int64_t pos = first, t = 0; pos < end;) {                                            \
        const int64_t block = block_table[pos / block_size];                                  \
        const int64_t offset = pos % block_size;                                              \
        const int64_t rest = end - pos;                                                       \
        const int64_t count = block_size - offset < rest ? block_size - offset : rest;        \
        int64_t index = ((block * block_size + offset) * num_kv_heads + kv) * head_dim;       \
        if (pos + count < end)  /* the next block is elsewhere in memory: request it now */     \
            prefetch_block(CACHE, block_table[(pos + count) / block_size], block_size,        \
                           num_kv_heads, kv, head_dim, elem_size);                            \
        for (int64_t s = 0; s < count; s++, t++, index += row_stride) { BODY }                \
        pos += count;                                                                         \
    }

/*
 * The cache rows of the sequence a thread attends next, requested a few lines at a time while it
 * computes the current one (spread over the query heads of each key tile and the kv heads of each
 * value tile), so that the next sequence streams in while this one computes. Without it, a thread
 * computes and waits on memory in turn. The requests ask for L2 (_MM_HINT_T1), where the next
 * sequence waits beside the current one, not for L1, whose 32-48 KiB the current tiles need: the
 * whole next sequence is requested (up to NEXT_SEQUENCE_BYTES; ~450 KiB at 220 fp32 tokens here).
 * Walking whole blocks (block_size contiguous rows) keeps the cost per line to a pointer bump.
 * benchmarks/decode_attention.py's setup (12 layers' caches of shuffled blocks), on the Zen 4
 * development machine, alternating with the previous requests (into L1, and only the first 256 KiB
 * of an fp32 sequence, which measured up to 9% faster than the whole one on Zen 5): 64 x 224 keys
 * bf16 1.01-1.03 -> 0.65-0.83 ms per call, fp32 1.90-2.11 -> 1.31-1.54; 16 x 1,024 bf16 1.24 ->
 * 0.79-0.85, fp32 2.19-2.49 -> 1.71-1.74; with nothing requested, 64 x 224 took as long as with
 * the L1 requests (bf16 1.03-1.14, fp32 1.9-2.0). On Zen 5 a T2 hint (the same as T1 on Zen 4)
 * measured as T0. Only for whole-sequence tasks, whose rows are read whole. On the Zen 3 (512 KiB
 * of L2) the AVX2 path measured the same: the whole sequence ahead of 256 KiB, 64 KiB and nothing
 * (64 x 224 keys bf16 1.8-2.2 ms against 1.8-2.2, 2.6-2.9 and 3.1-3.5; 16 x 1,024 fp32 4.1-4.9
 * against 3.9-4.9, 4.0-4.8 and 5.3-5.7).
 */
enum { NEXT_SEQUENCE_BYTES = 4096 * 1024 };

/* Sequences with more keys to attend to than this are split into chunks of this many, each its own
 * task, merged afterwards (attention_tasks): so that a long sequence streams as a row of short
 * ones does, its next chunk requested while a thread computes the current one (requesting the
 * current sequence's own rows further ahead, 2 to 64 tiles, changed nothing). With 12 layers'
 * caches of shuffled blocks (benchmarks/decode_attention.py's setup), two alternating rounds:
 * bf16 4 x 4,096 keys 1.34-1.41 -> 0.57-0.60 ms per call, 16 x 1,024 0.68-0.70 -> 0.57-0.61,
 * fp32 4 x 4,096 1.64-1.68 -> 1.19-1.27; 64 x 224 unchanged. */
enum { CHUNK_KEYS = 512 };

/* A small batch (too few keys for CHUNK_KEYS-key chunks to give every thread SMALL_BATCH_TASKS
 * of them) is cut into shorter chunks that do, so that its tasks still read whole cache rows,
 * every kv head of a run of keys, instead of one kv head's slice of each row, and a thread's next
 * chunk is requested while it computes the current one; unless they would be shorter than
 * MIN_CHUNK_KEYS (one sequence of 40 keys in chunks of 32: 0.9x). Against the kv head split,
 * benchmarks/decode_attention_ab.c --cold (Zen 3): one sequence of 320 bf16 keys (the batch-1
 * benchmark's, in chunks of 40) 1.13-1.33x, of 1,024 1.24x, 4 x 300 1.26-1.30x, fp32 1 x 320
 * 1.26-1.27x; from 8 sequences the chunks are as before. */
enum { SMALL_BATCH_TASKS = 4, MIN_CHUNK_KEYS = 32 };

typedef struct {
    const char *caches[2];           /* keys, then values */
    const int64_t *block_table;
    int64_t first_block, end_block;  /* the window's blocks, as indices into block_table */
    int64_t block_bytes;             /* a whole block: block_size rows, contiguous */
    int64_t first_offset, last_end;  /* the rows in use: from first_offset bytes into the first
                                        block to last_end bytes into the last */
    int64_t lines_per_tile;          /* to request over one tile of the current sequence */
    int64_t remaining;               /* lines still to request */
    int cache;                       /* which of caches[] is being requested */
    int64_t block;                   /* the next block to start, an index into block_table */
    const char *cursor, *end;        /* the lines left of the block being requested */
} next_sequence;

static inline void request_next(next_sequence *next, int64_t lines) {
#if defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)
    const char *cursor = next->cursor, *end = next->end;
    lines = lines < next->remaining ? lines : next->remaining;
    next->remaining -= lines;  /* not in the loop: a store there would chain every iteration */
    for (; lines > 0; lines--, cursor += 64) {
        if (cursor >= end) {
            if (next->block == next->end_block) {  /* the keys are all requested: the values */
                next->cache++;
                next->block = next->first_block;
            }
            const char *base = next->caches[next->cache] + next->block_table[next->block] * next->block_bytes;
            cursor = base + (next->block == next->first_block ? next->first_offset : 0);
            end = base + (next->block + 1 == next->end_block ? next->last_end : next->block_bytes);
            next->block++;
        }
        _mm_prefetch(cursor, _MM_HINT_T1);
    }
    next->cursor = cursor;
    next->end = end;
#else
    (void)next;
    (void)lines;
#endif
}

/*
 * Attention of one sequence's query heads that use kv heads [kv_first, kv_first + kv_count).
 * Head by head: the query (or the output accumulator) stays in registers while the loop streams
 * over the keys (values); the G query heads of one kv head re-read its rows from cache, not
 * from memory.
 */
static inline __attribute__((always_inline)) void attend_one(
        const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
        int64_t first, int64_t end, int64_t seq, int64_t kv_first, int64_t kv_count,
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
        float scale, float softcap, int dtype, float *scratch, next_sequence *next, float *partial) {
    (void)next;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_keys = end - first;
    const int64_t row_stride = num_kv_heads * head_dim;
    const int64_t elem_size = kv_elem_size(dtype);
    const int kv_dtype = kv_dtype_of(dtype);
    float *buffer = scratch;                 /* head_dim */
    float *scores = scratch + head_dim;      /* num_keys */
    float query[head_dim], acc[head_dim];

    for (int64_t kv = kv_first; kv < kv_first + kv_count; kv++) {
        for (int64_t g = 0; g < group; g++) {
            const int64_t head_index = (seq * num_heads + kv * group + g) * head_dim;
            const float *qrow = row_f32(q, head_index, head_dim, q_dtype_of(dtype), buffer);
            for (int64_t d = 0; d < head_dim; d++) query[d] = qrow[d] * scale;
            float max_score = -3.0e38f;  /* finite: built with finite math */
            FOR_EACH_KEY(k_cache, {
                float dot = 0.0f;
                if (dtype == DTYPE_F32) {
                    const float *k = (const float *)k_cache + index;
                    for (int64_t d = 0; d < head_dim; d++) dot += query[d] * k[d];
                } else if (dtype == DTYPE_BF16) {
                    dot = dot_bf16(q, head_index, k_cache, index, head_dim, scale, query);
                } else {
                    const float *k = fp8_row_f32(k_cache, index, head_dim, kv_dtype, buffer);
                    for (int64_t d = 0; d < head_dim; d++) dot += query[d] * k[d];
                }
                scores[t] = dot;
                max_score = dot > max_score ? dot : max_score;
            })
            if (softcap > 0.0f) {  /* monotonic: the largest score stays the largest */
                soft_cap(scores, num_keys, softcap);
                soft_cap(&max_score, 1, softcap);
            }
            float sum = 0.0f;
            for (int64_t i = 0; i < num_keys; i++) {
                scores[i] = expf(scores[i] - max_score);
                sum += scores[i];
            }
            for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;
            FOR_EACH_KEY(v_cache, {
                const float w = scores[t];
                if (dtype == DTYPE_F32) {
                    const float *v = (const float *)v_cache + index;
                    for (int64_t d = 0; d < head_dim; d++) acc[d] += w * v[d];
                } else if (dtype == DTYPE_BF16) {
                    const uint16_t *v = (const uint16_t *)v_cache + index;
                    for (int64_t d = 0; d < head_dim; d++) acc[d] += w * bf16_to_f32(v[d]);
                } else {
                    const float *v = fp8_row_f32(v_cache, index, head_dim, kv_dtype, buffer);
                    for (int64_t d = 0; d < head_dim; d++) acc[d] += w * v[d];
                }
            })
            float *dst = partial + ((kv - kv_first) * group + g) * (head_dim + 2);
            dst[0] = max_score;
            dst[1] = sum;
            for (int64_t d = 0; d < head_dim; d++) dst[2 + d] = acc[d];
        }
    }
}

#if defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)
/* Keys (values) per tile of the vector paths. */
enum { TILE = 16 };

/* 16 fp8 bytes (kv: KV_DTYPE_*) as fp16 bits: e5m2 is the high byte of an fp16; e4m3fn's
 * magnitude shifted into an fp16 is its value times 2^-8 (subnormals included), so the caller
 * multiplies by 256 after widening; e4m3fn's NaN (0x7F, which would read as 480) an fp16 NaN. */
static inline __m256i fp8_as_fp16(__m128i bytes, int kv) {
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    if (kv == KV_DTYPE_E5M2) return _mm256_slli_epi16(wide, 8);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    const __m256i low = _mm256_and_si256(wide, _mm256_set1_epi16(0x7F));
    const __m256i magnitude = _mm256_blendv_epi8(_mm256_slli_epi16(low, 7), _mm256_set1_epi16(0x7E00),
                                                 _mm256_cmpeq_epi16(low, _mm256_set1_epi16(0x7F)));
    return _mm256_or_si256(sign, magnitude);
}

static inline void prefetch_bytes(const void *base, int64_t index, int64_t bytes, int64_t elem_size) {
    const char *start = (const char *)base + index * elem_size;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
}

/* offsets[t], t < stride: the element offset of key first + t's row slice from kv head kv_first;
 * tails past num_keys repeat the last key, so that every tile's addresses are valid. Block by
 * block, one division per sequence rather than one per key. */
static inline void key_offsets(int64_t *offsets, int64_t stride, int64_t first, int64_t num_keys,
                               const int64_t *block_table, int64_t block_size, int64_t num_kv_heads,
                               int64_t kv_first, int64_t head_dim) {
    const int64_t row = num_kv_heads * head_dim;  /* elements per cache row */
    int64_t block = first / block_size, slot = first % block_size;
    int64_t t = 0;
    for (; t < num_keys; block++, slot = 0) {
        const int64_t base = (block_table[block] * block_size * num_kv_heads + kv_first) * head_dim;
        for (; slot < block_size && t < num_keys; slot++, t++) offsets[t] = base + slot * row;
    }
    for (; t < stride; t++) offsets[t] = offsets[num_keys - 1];
}

/* Each of `heads` score rows (stride apart, num_keys long) replaced by exp(score - its largest),
 * the largest and the sum of the exponentials kept per row. The largest comes from one vectorised
 * pass over the row, not from a horizontal maximum per tile (that reduction was ~7% of a call's
 * instructions with AVX-512). */
static inline void exponentiate_rows(float *scores, int64_t heads, int64_t stride, int64_t num_keys,
                                     float *max_scores, float *sums) {
    for (int64_t h = 0; h < heads; h++) {
        float *row = scores + h * stride, max_score = row[0], sum = 0.0f;
        for (int64_t t = 1; t < num_keys; t++) max_score = row[t] > max_score ? row[t] : max_score;
        max_scores[h] = max_score;
#if defined(__AVX512F__)
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < num_keys; t += 16) {
            const __mmask16 in = num_keys - t >= 16 ? 0xFFFF : (__mmask16)((1u << (num_keys - t)) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(
                in, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, row + t), _mm512_set1_ps(max_score))));
            _mm512_mask_storeu_ps(row + t, in, e);
            total = _mm512_add_ps(total, e);
        }
        sum = _mm512_reduce_add_ps(total);
#else
        for (int64_t t = 0; t < num_keys; t++) {
            row[t] = expf(row[t] - max_score);
            sum += row[t];
        }
#endif
        sums[h] = sum;
    }
}

/* The task's softmax parts, as attend_fn returns them: per head its largest score, its sum and
 * its weighted values (acc, heads x head_dim). */
static inline void store_partials(float *partial, const float *max_scores, const float *sums,
                                  const float *acc, int64_t heads, int64_t head_dim) {
    for (int64_t h = 0; h < heads; h++) {
        float *dst = partial + h * (head_dim + 2);
        dst[0] = max_scores[h];
        dst[1] = sums[h];
        memcpy(dst + 2, acc + h * head_dim, head_dim * sizeof(float));
    }
}

#endif

#if defined(__AVX512F__)
/*
 * The AVX-512 path, for head sizes that are a multiple of 16 (up to 256). It walks the keys (then
 * the values) 16 tokens at a time and, per tile, serves every query head of the task from the
 * tile's rows while the next tile's rows (all of the task's kv heads: whole contiguous rows when
 * the task is a whole sequence) are prefetched. Reading a cache row whole, in token order, is
 * what lets the cache stream: a block is only a few KiB, so the hardware prefetcher (which stops
 * at page boundaries) cannot run ahead on its own, and reading one kv head's slice of every row
 * per pass wastes most of each fetch. Scores come 16 keys at a time out of one transposing
 * reduction (sum_lanes_16) instead of a horizontal sum per key.
 */


/* Lane i of the result = the sum of the 16 lanes of v[i]. */
static inline __m512 sum_lanes_16(const __m512 v[16]) {
    __m512 pairs[8], quads[4], octs[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: lanes 0+2 and 1+3 of rows 2i and 2i+1 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: one partial sum of each of 4 rows */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0+1 and 2+3 of two quads */
        octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88),
                         _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}

/* 16 consecutive elements of a cache (dtype: a decode dtype argument) as fp32, exactly. */
static inline __m512 load_cache16(const void *base, int64_t index, int dtype) {
    const int kv = kv_dtype_of(dtype);
    if (kv == DTYPE_F32 || kv == DTYPE_BF16) return load16(base, index, kv);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + index));
    const __m512 x = _mm512_cvtph_ps(fp8_as_fp16(bytes, kv));
    return kv == KV_DTYPE_E5M2 ? x : _mm512_mul_ps(x, _mm512_set1_ps(256.0f));
}

/* q . k as 16 partial sums. bf16 with AVX512-BF16: vdpbf16ps on the unscaled bf16 query (the
 * caller scales the sums); otherwise FMAs with the scaled fp32 query. */
static inline __m512 partial_dot(const __m512 *query, const uint16_t *q_bf16, const void *k_cache,
                                 int64_t index, const int64_t head_dim, int dtype) {
    __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (dtype == DTYPE_BF16 && head_dim % 32 == 0) {
        for (int64_t d = 0; d < head_dim; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q_bf16 + d),
                                   (__m512bh)_mm512_loadu_si512((const uint16_t *)k_cache + index + d));
        return acc;
    }
#endif
    (void)q_bf16;
    for (int64_t c = 0; c < head_dim / 16; c++)
        acc = _mm512_fmadd_ps(query[c], load_cache16(k_cache, index + 16 * c, dtype), acc);
    return acc;
}

/* The TILE key rows at offsets[j] + kv_offset of an fp8 cache (dtype: a decode dtype argument)
 * widened once into stage, TILE rows of head_dim values in the queries' dtype (to bf16 by dropping
 * the low half of each fp32, exact: every e4m3 and e5m2 value is a bf16 one). The kv head's query
 * heads then read the stage as a cache of their own dtype, so the widening is paid once per kv
 * head rather than once per query head, and bf16 queries multiply by vdpbf16ps as over a bf16
 * cache. */
static inline void stage_keys(void *stage, const void *k_cache, const int64_t *offsets, int64_t kv_offset,
                              const int64_t head_dim, int dtype) {
    for (int64_t j = 0; j < TILE; j++)
        for (int64_t c = 0; c < head_dim; c += 16) {
            const __m512 x = load_cache16(k_cache, offsets[j] + kv_offset + c, dtype);
            if (q_dtype_of(dtype) == DTYPE_F32)
                _mm512_storeu_ps((float *)stage + j * head_dim + c, x);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)stage + j * head_dim + c),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
        }
}

/* acc[g] += sum over the tile's keys of probs[g][t] * value row t, for `count` query heads of
 * one kv head (a constant at each call site, so acc stays in registers). */
static inline __attribute__((always_inline)) void accumulate_tile(
        const void *v_cache, const int64_t *offsets, int64_t tile, int64_t kv_offset,
        const float *probs, int64_t probs_stride, const int count, const int64_t head_dim,
        int dtype, float *acc) {
    enum { MAX_HEADS = 4, MAX_VECTORS = 16 };
    const int64_t vectors = head_dim / 16;
    __m512 sums[MAX_HEADS][MAX_VECTORS];
    for (int g = 0; g < count; g++)
        for (int64_t c = 0; c < vectors; c++) sums[g][c] = _mm512_loadu_ps(acc + g * head_dim + 16 * c);
    for (int64_t t = 0; t < tile; t++) {
        const int64_t index = offsets[t] + kv_offset;
        for (int64_t c = 0; c < vectors; c++) {
            const __m512 value = load_cache16(v_cache, index + 16 * c, dtype);
            for (int g = 0; g < count; g++)
                sums[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g * probs_stride + t]), value, sums[g][c]);
        }
    }
    for (int g = 0; g < count; g++)
        for (int64_t c = 0; c < vectors; c++) _mm512_storeu_ps(acc + g * head_dim + 16 * c, sums[g][c]);
}

static inline __attribute__((always_inline)) void attend_avx512(
        const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
        int64_t first, int64_t end, int64_t seq, int64_t kv_first, int64_t kv_count,
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
        float scale, float softcap, int dtype, float *scratch, next_sequence *next, float *partial) {
    const int64_t group = num_heads / num_kv_heads, heads = kv_count * group;
    const int64_t num_keys = end - first;
    const int64_t stride = (num_keys + TILE - 1) / TILE * TILE;
    const int64_t vectors = head_dim / 16, elem_size = kv_elem_size(dtype);
    const int64_t slice_bytes = kv_count * head_dim * elem_size;  /* the task's part of a row */
    const int heads_per_pass = vectors >= 4 ? (int)(16 / vectors) : 4;  /* <= 16 accumulators */
    const int64_t head0 = seq * num_heads + kv_first * group;  /* the task's first query head */
    int64_t *offsets = (int64_t *)scratch;        /* stride: each key's slice, in elements */
    float *scores = scratch + 2 * stride;          /* heads x stride */
    float *acc = scores + heads * stride;          /* heads x head_dim */
    const int fp8 = dtype >> 4, dot_dtype = fp8 ? q_dtype_of(dtype) : dtype;  /* what partial_dot reads */
    float *stage = fp8 ? acc + heads * head_dim : NULL;  /* fp8: TILE x head_dim staged keys */
    key_offsets(offsets, stride, first, num_keys, block_table, block_size, num_kv_heads, kv_first, head_dim);
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        for (int64_t h = 0; h < heads; h++) {
            request_next(next, (next->lines_per_tile + heads - 1) / heads);
            const int64_t kv_offset = (h / group) * head_dim;
            const int64_t q_index = (head0 + h) * head_dim;
            __m512 query[16], partial[TILE];
            for (int64_t c = 0; c < vectors; c++)
                query[c] = _mm512_mul_ps(load16(q, q_index + 16 * c, q_dtype_of(dtype)), _mm512_set1_ps(scale));
            if (fp8 && h % group == 0) stage_keys(stage, k_cache, offsets + t0, kv_offset, head_dim, dtype);
            for (int64_t j = 0; j < TILE; j++) {
                if (h == 0 && t0 + 2 * TILE + j < num_keys)
                    prefetch_bytes(k_cache, offsets[t0 + 2 * TILE + j], slice_bytes, elem_size);
                partial[j] = fp8 ? partial_dot(query, (const uint16_t *)q + q_index, stage, j * head_dim,
                                               head_dim, dot_dtype)
                                 : partial_dot(query, (const uint16_t *)q + q_index, k_cache,
                                               offsets[t0 + j] + kv_offset, head_dim, dtype);
            }
            __m512 tile_scores = sum_lanes_16(partial);
#if defined(__AVX512BF16__)
            if (dot_dtype == DTYPE_BF16 && head_dim % 32 == 0)
                tile_scores = _mm512_mul_ps(tile_scores, _mm512_set1_ps(scale));
#endif
            _mm512_storeu_ps(scores + h * stride + t0, tile_scores);
        }
    }
    if (softcap > 0.0f)
        for (int64_t h = 0; h < heads; h++) soft_cap(scores + h * stride, num_keys, softcap);
    float max_scores[heads], sums[heads];
    exponentiate_rows(scores, heads, stride, num_keys, max_scores, sums);
    for (int64_t i = 0; i < heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        const int64_t tile = num_keys - t0 < TILE ? num_keys - t0 : TILE;
        for (int64_t j = 0; j < tile && t0 + 2 * TILE + j < num_keys; j++)
            prefetch_bytes(v_cache, offsets[t0 + 2 * TILE + j], slice_bytes, elem_size);
        for (int64_t kv = 0; kv < kv_count; kv++)
            for (int64_t g0 = 0; g0 < group; g0 += heads_per_pass) {
                request_next(next, (next->lines_per_tile + kv_count - 1) / kv_count);
                const int count = group - g0 < heads_per_pass ? (int)(group - g0) : heads_per_pass;
                const int64_t h = kv * group + g0;
                const float *probs = scores + h * stride + t0;
                float *head_acc = acc + h * head_dim;
#define ACCUMULATE(COUNT) \
    accumulate_tile(v_cache, offsets + t0, tile, kv * head_dim, probs, stride, COUNT, head_dim, dtype, \
                    head_acc)
                switch (count) {  /* a constant count per call keeps the accumulators in registers */
                    case 1: ACCUMULATE(1); break;
                    case 2: ACCUMULATE(2); break;
                    case 3: ACCUMULATE(3); break;
                    default: ACCUMULATE(4); break;
                }
#undef ACCUMULATE
            }
    }
    store_partials(partial, max_scores, sums, acc, heads, head_dim);
}
#elif defined(SLIPSTREAM_AVX2)
/*
 * The AVX2 path (Zen 1-3, Haswell to Alder Lake), for head sizes that are a multiple of 32: the
 * AVX-512 path's walk (tiles of 16 keys, every query head of the task served from each tile's
 * rows, the next tiles and the next sequence requested meanwhile) in 8-lane vectors. With 16
 * vector registers the scaled query stays in L1, not in registers, and each pass over a tile's
 * values accumulates 32 columns of up to 3 query heads (12 accumulators).
 */

/* 8 consecutive elements of a cache (dtype: a decode dtype argument) as fp32, exactly; fp8 through
 * fp16 (F16C) as load_cache16 widens it, not per element (cache_value). */
static inline __m256 load8(const void *base, int64_t index, int dtype) {
    const int kv = kv_dtype_of(dtype);
    if (kv == DTYPE_F32) return _mm256_loadu_ps((const float *)base + index);
    if (kv == DTYPE_BF16) return widen_bf16_8((const uint16_t *)base + index);
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + index));
    const __m256 x = _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_as_fp16(bytes, kv)));
    return kv == KV_DTYPE_E5M2 ? x : _mm256_mul_ps(x, _mm256_set1_ps(256.0f));
}

/* The TILE key rows at offsets[j] + kv_offset of an fp8 cache widened once into stage (TILE x
 * head_dim fp32), so that a kv head's query heads pay the widening once between them. */
static inline void stage_keys_8(float *stage, const void *k_cache, const int64_t *offsets, int64_t kv_offset,
                                const int64_t head_dim, int dtype) {
    for (int64_t j = 0; j < TILE; j++)
        for (int64_t c = 0; c < head_dim; c += 8)
            _mm256_storeu_ps(stage + j * head_dim + c, load8(k_cache, offsets[j] + kv_offset + c, dtype));
}

/* Lane i of the result = the sum of the 8 lanes of v[i]. */
static inline __m256 sum_lanes_8x8(const __m256 v[8]) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  /* halves' sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

enum { VALUE_HEADS = 3, VALUE_VECTORS = 4 };  /* per pass over a tile's values */

/* acc[g][0:32] += sum over the tile's keys of probs[g][t] * value row t's columns [0, 32) (from
 * kv_offset), for `count` query heads of one kv head (a constant at each call site). */
static inline __attribute__((always_inline)) void accumulate_tile_8(
        const void *v_cache, const int64_t *offsets, int64_t tile, int64_t kv_offset,
        const float *probs, int64_t probs_stride, const int count, const int64_t head_dim,
        int dtype, float *acc) {
    __m256 sums[VALUE_HEADS][VALUE_VECTORS];
    for (int g = 0; g < count; g++)
        for (int c = 0; c < VALUE_VECTORS; c++) sums[g][c] = _mm256_loadu_ps(acc + g * head_dim + 8 * c);
    for (int64_t t = 0; t < tile; t++) {
        const int64_t index = offsets[t] + kv_offset;
        for (int c = 0; c < VALUE_VECTORS; c++) {
            const __m256 value = load8(v_cache, index + 8 * c, dtype);
            for (int g = 0; g < count; g++)
                sums[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(probs + g * probs_stride + t), value,
                                             sums[g][c]);
        }
    }
    for (int g = 0; g < count; g++)
        for (int c = 0; c < VALUE_VECTORS; c++) _mm256_storeu_ps(acc + g * head_dim + 8 * c, sums[g][c]);
}

static inline __attribute__((always_inline)) void attend_avx2(
        const void *q, const void *k_cache, const void *v_cache, const int64_t *block_table,
        int64_t first, int64_t end, int64_t seq, int64_t kv_first, int64_t kv_count,
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
        float scale, float softcap, int dtype, float *scratch, next_sequence *next, float *partial) {
    const int64_t group = num_heads / num_kv_heads, heads = kv_count * group;
    const int64_t num_keys = end - first;
    const int64_t stride = (num_keys + TILE - 1) / TILE * TILE;
    const int64_t vectors = head_dim / 8, elem_size = kv_elem_size(dtype);
    const int64_t slice_bytes = kv_count * head_dim * elem_size;  /* the task's part of a row */
    const int64_t head0 = seq * num_heads + kv_first * group;  /* the task's first query head */
    const int64_t value_passes =  /* request_next calls per value tile */
        kv_count * (vectors / VALUE_VECTORS) * ((group + VALUE_HEADS - 1) / VALUE_HEADS);
    int64_t *offsets = (int64_t *)scratch;        /* stride: each key's slice, in elements */
    float *scores = scratch + 2 * stride;          /* heads x stride */
    float *acc = scores + heads * stride;          /* heads x head_dim */
    const int fp8 = dtype >> 4;
    float *stage = fp8 ? acc + heads * head_dim : NULL;  /* fp8: TILE x head_dim staged keys */
    key_offsets(offsets, stride, first, num_keys, block_table, block_size, num_kv_heads, kv_first, head_dim);
    float query[head_dim];
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        for (int64_t h = 0; h < heads; h++) {
            request_next(next, (next->lines_per_tile + heads - 1) / heads);
            const int64_t kv_offset = (h / group) * head_dim;
            for (int64_t c = 0; c < vectors; c++)
                _mm256_storeu_ps(query + 8 * c, _mm256_mul_ps(load8(q, (head0 + h) * head_dim + 8 * c,
                                                                    q_dtype_of(dtype)), _mm256_set1_ps(scale)));
            if (fp8 && h % group == 0) stage_keys_8(stage, k_cache, offsets + t0, kv_offset, head_dim, dtype);
            for (int64_t j0 = 0; j0 < TILE; j0 += 8) {
                __m256 partial_dots[8];
                for (int64_t j = 0; j < 8; j++) {
                    const int64_t t = t0 + j0 + j;
                    if (h == 0 && t + 2 * TILE < num_keys)
                        prefetch_bytes(k_cache, offsets[t + 2 * TILE], slice_bytes, elem_size);
                    partial_dots[j] = _mm256_setzero_ps();
                }
                /* The eight keys' sums step together over the head dimension (each key's in the
                 * same order as one key at a time, so bit for bit the same): bf16, 64 x 224 keys
                 * from memory, 1.05x (decode_attention_ab.c, Zen 3); fp32 even. */
                const int64_t *keys = offsets + t0 + j0;
                for (int64_t c = 0; c < vectors; c++) {
                    const __m256 query_c = _mm256_loadu_ps(query + 8 * c);
                    for (int64_t j = 0; j < 8; j++) {
                        const __m256 key = fp8 ? _mm256_loadu_ps(stage + (j0 + j) * head_dim + 8 * c)
                                               : load8(k_cache, keys[j] + kv_offset + 8 * c, dtype);
                        partial_dots[j] = _mm256_fmadd_ps(query_c, key, partial_dots[j]);
                    }
                }
                _mm256_storeu_ps(scores + h * stride + t0 + j0, sum_lanes_8x8(partial_dots));
            }
        }
    }
    if (softcap > 0.0f)
        for (int64_t h = 0; h < heads; h++) soft_cap(scores + h * stride, num_keys, softcap);
    float max_scores[heads], sums[heads];
    exponentiate_rows(scores, heads, stride, num_keys, max_scores, sums);
    for (int64_t i = 0; i < heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t t0 = 0; t0 < num_keys; t0 += TILE) {
        const int64_t tile = num_keys - t0 < TILE ? num_keys - t0 : TILE;
        for (int64_t j = 0; j < tile && t0 + 2 * TILE + j < num_keys; j++)
            prefetch_bytes(v_cache, offsets[t0 + 2 * TILE + j], slice_bytes, elem_size);
        for (int64_t kv = 0; kv < kv_count; kv++)
            for (int64_t c0 = 0; c0 < vectors; c0 += VALUE_VECTORS)
                for (int64_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
                    request_next(next, (next->lines_per_tile + value_passes - 1) / value_passes);
                    const int count = group - g0 < VALUE_HEADS ? (int)(group - g0) : VALUE_HEADS;
                    const int64_t h = kv * group + g0;
                    const float *probs = scores + h * stride + t0;
                    float *head_acc = acc + h * head_dim + 8 * c0;
#define ACCUMULATE(COUNT) \
    accumulate_tile_8(v_cache, offsets + t0, tile, kv * head_dim + 8 * c0, probs, stride, COUNT, head_dim, \
                      dtype, head_acc)
                    switch (count) {  /* a constant count per call keeps the accumulators in registers */
                        case 1: ACCUMULATE(1); break;
                        case 2: ACCUMULATE(2); break;
                        default: ACCUMULATE(3); break;
                    }
#undef ACCUMULATE
                }
    }
    store_partials(partial, max_scores, sums, acc, heads, head_dim);
}
#endif

/* Attention of query heads [kv_first * G, (kv_first + kv_count) * G) of sequence `seq` over its
 * keys [first, end), as its softmax's parts: per head the largest score, the sum of exp(score -
 * largest) and the values weighted by those, into partial (heads x (head_dim + 2) floats), for
 * attention_tasks to normalise, or to merge with the sequence's other chunks. */
typedef void (*attend_fn)(const void *, const void *, const void *, const int64_t *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          float, float, int, float *, next_sequence *, float *);

#define DEFINE_ATTEND(NAME, IMPL, HEAD_DIM, DTYPE)                                             \
    static void NAME(const void *q, const void *k, const void *v, const int64_t *table,       \
                     int64_t first, int64_t end, int64_t seq, int64_t kv_first,                \
                     int64_t kv_count, int64_t num_heads, int64_t num_kv_heads,                \
                     int64_t head_dim, int64_t block_size, float scale, float softcap,         \
                     int dtype, float *scratch, next_sequence *next, float *partial) {         \
        (void)dtype; (void)head_dim;                                                           \
        IMPL(q, k, v, table, first, end, seq, kv_first, kv_count, num_heads, num_kv_heads,    \
             HEAD_DIM, block_size, scale, softcap, DTYPE, scratch, next, partial);             \
    }
/* Constant head sizes and dtypes let the compiler unroll and drop branches in the hot loops. The
 * portable loop at any head size (variable-length arrays) gets a copy per 16- or 32-bit dtype, so
 * that the fp8 branches cost an fp32 or bf16 cache nothing (one copy for all three ran 2-5%
 * slower at head size 80 or 32), and one for the fp8 caches. */
DEFINE_ATTEND(attend_any_f32, attend_one, head_dim, DTYPE_F32)
DEFINE_ATTEND(attend_any_bf16, attend_one, head_dim, DTYPE_BF16)
DEFINE_ATTEND(attend_any_fp8, attend_one, head_dim, dtype)
#if defined(__AVX512F__)
#define ATTEND_SPECIALISED attend_avx512
#elif defined(SLIPSTREAM_AVX2)
#define ATTEND_SPECIALISED attend_avx2
#else
#define ATTEND_SPECIALISED attend_one
#endif
DEFINE_ATTEND(attend_f32_d64, ATTEND_SPECIALISED, 64, DTYPE_F32)
DEFINE_ATTEND(attend_f32_d128, ATTEND_SPECIALISED, 128, DTYPE_F32)
DEFINE_ATTEND(attend_bf16_d64, ATTEND_SPECIALISED, 64, DTYPE_BF16)
DEFINE_ATTEND(attend_bf16_d128, ATTEND_SPECIALISED, 128, DTYPE_BF16)
DEFINE_ATTEND(attend_f32_d256, ATTEND_SPECIALISED, 256, DTYPE_F32)
DEFINE_ATTEND(attend_bf16_d256, ATTEND_SPECIALISED, 256, DTYPE_BF16)
#undef ATTEND_SPECIALISED
/* fp8 caches: the vector paths, which widen a tile's keys once per kv head (and each value as
 * they read it, 16 or 8 at a time); copies with the dtypes constant at the commonest head sizes
 * on AVX-512, one over the dtype argument otherwise. Without AVX2, or at head sizes the vector
 * paths do not take, the portable loop, which widens element by element per query head. */
#if defined(__AVX512F__)
DEFINE_ATTEND(attend_f32_e4m3_d64, attend_avx512, 64, DTYPE_F32 | KV_DTYPE_E4M3 << 4)
DEFINE_ATTEND(attend_f32_e5m2_d64, attend_avx512, 64, DTYPE_F32 | KV_DTYPE_E5M2 << 4)
DEFINE_ATTEND(attend_bf16_e4m3_d64, attend_avx512, 64, DTYPE_BF16 | KV_DTYPE_E4M3 << 4)
DEFINE_ATTEND(attend_bf16_e5m2_d64, attend_avx512, 64, DTYPE_BF16 | KV_DTYPE_E5M2 << 4)
DEFINE_ATTEND(attend_f32_e4m3_d128, attend_avx512, 128, DTYPE_F32 | KV_DTYPE_E4M3 << 4)
DEFINE_ATTEND(attend_f32_e5m2_d128, attend_avx512, 128, DTYPE_F32 | KV_DTYPE_E5M2 << 4)
DEFINE_ATTEND(attend_bf16_e4m3_d128, attend_avx512, 128, DTYPE_BF16 | KV_DTYPE_E4M3 << 4)
DEFINE_ATTEND(attend_bf16_e5m2_d128, attend_avx512, 128, DTYPE_BF16 | KV_DTYPE_E5M2 << 4)
DEFINE_ATTEND(attend_fp8_d256, attend_avx512, 256, dtype)
DEFINE_ATTEND(attend_fp8_any16, attend_avx512, head_dim, dtype)

static attend_fn choose_fp8_kernel(int64_t head_dim, int dtype) {
    const attend_fn d64[2][2] = {{attend_f32_e4m3_d64, attend_f32_e5m2_d64},
                                 {attend_bf16_e4m3_d64, attend_bf16_e5m2_d64}};
    const attend_fn d128[2][2] = {{attend_f32_e4m3_d128, attend_f32_e5m2_d128},
                                  {attend_bf16_e4m3_d128, attend_bf16_e5m2_d128}};
    const int q = q_dtype_of(dtype), kv = kv_dtype_of(dtype) - KV_DTYPE_E4M3;
    if (!valid_cache_dtype(dtype) || !(dtype >> 4)) return attend_any_fp8;  /* never past the tables */
    if (head_dim == 64) return d64[q][kv];
    if (head_dim == 128) return d128[q][kv];
    if (head_dim == 256) return attend_fp8_d256;
    if (head_dim % 16 == 0 && head_dim <= 256) return attend_fp8_any16;
    return attend_any_fp8;
}
#elif defined(SLIPSTREAM_AVX2)
DEFINE_ATTEND(attend_fp8_d64, attend_avx2, 64, dtype)
DEFINE_ATTEND(attend_fp8_d128, attend_avx2, 128, dtype)
DEFINE_ATTEND(attend_fp8_d256, attend_avx2, 256, dtype)

static attend_fn choose_fp8_kernel(int64_t head_dim, int dtype) {
    (void)dtype;
    if (head_dim == 64) return attend_fp8_d64;
    if (head_dim == 128) return attend_fp8_d128;
    if (head_dim == 256) return attend_fp8_d256;
    return attend_any_fp8;
}
#else
static attend_fn choose_fp8_kernel(int64_t head_dim, int dtype) {
    (void)head_dim; (void)dtype;
    return attend_any_fp8;
}
#endif

/* Other head sizes take the portable loop: the families served use 64 or 128 (Llama, Mistral,
 * Qwen2/3) or 256 (every Gemma), and each further pair of copies adds to every first build. */
static attend_fn choose_kernel(int64_t head_dim, int dtype) {
    if (dtype >> 4) return choose_fp8_kernel(head_dim, dtype);
    if (head_dim == 64) return dtype == DTYPE_F32 ? attend_f32_d64 : attend_bf16_d64;
    if (head_dim == 128) return dtype == DTYPE_F32 ? attend_f32_d128 : attend_bf16_d128;
    if (head_dim == 256) return dtype == DTYPE_F32 ? attend_f32_d256 : attend_bf16_d256;
    return dtype == DTYPE_F32 ? attend_any_f32 : attend_any_bf16;
}

int64_t max_seq_len(const int64_t *seq_lens, int64_t num_seqs) {
    int64_t max_len = 0;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    return max_len;
}

/* Per-thread scratch of the attention: a task's partial results (num_heads x (head_dim + 2)), then
 * what the kernels need: attend_one a row and the scores; attend_avx512 the keys' offsets
 * (int64), every head's scores, and the value accumulators. */
int64_t attention_scratch_floats(int64_t max_len, int64_t num_heads, int64_t head_dim) {
    /* the merged chunks' partials, then a task's key offsets, scores, sums and (fp8) staged keys */
    return num_heads * (head_dim + 2) + (2 + num_heads) * (max_len + 16) + (num_heads + 1 + 16) * head_dim;
}

/* This thread's attention scratch (attention_scratch_floats() of them), or NULL with *failed set
 * when it cannot be allocated. Called inside a parallel region; the caller frees it. */
float *thread_scratch(int64_t floats, int *failed) {
    float *scratch = malloc(floats * sizeof(float));
    if (scratch == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return scratch;
}

/* The first key a decode query of a sequence of `len` tokens attends to. */
static inline int64_t first_key(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

int plan_decode_split(const int64_t *seq_lens, int64_t num_seqs, int64_t window, int64_t num_heads,
                      int64_t head_dim, int num_threads, decode_split *split) {
    split->partials = NULL;
    split->chunk_start = malloc((num_seqs + 1) * sizeof(int64_t));
    if (split->chunk_start == NULL) return 1;
    int64_t *chunk_start = split->chunk_start, total_keys = 0;
    for (int64_t s = 0; s < num_seqs; s++) total_keys += seq_lens[s] - first_key(seq_lens[s], window);
    const int64_t tasks = (int64_t)SMALL_BATCH_TASKS * num_threads;
    int64_t chunk = (total_keys + tasks - 1) / tasks;
    chunk = chunk > CHUNK_KEYS || chunk < MIN_CHUNK_KEYS ? CHUNK_KEYS : chunk;
    split->chunk_keys = chunk;
    chunk_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t keys = seq_lens[s] - first_key(seq_lens[s], window);
        chunk_start[s + 1] = chunk_start[s] + (keys > chunk ? (keys + chunk - 1) / chunk : 1);
    }
    if (chunk_start[num_seqs] == num_seqs) return 0;  /* nothing split */
    split->partials = malloc(chunk_start[num_seqs] * num_heads * (head_dim + 2) * sizeof(float));
    if (split->partials == NULL) {
        free(split->chunk_start);
        return 1;
    }
    return 0;
}

void free_decode_split(decode_split *split) {
    free(split->chunk_start);
    free(split->partials);
}

/* Rows of out for query heads [h0, h0 + num_heads_out) of sequence `seq`: the softmax merged over
 * `chunks` partial results (attend_fn's) `chunk_stride` floats apart, as FlashDecoding merges a
 * split sequence (Dao et al. 2023, "Flash-Decoding for long-context inference"); with one chunk,
 * its weighted values over its sum. */
static void write_heads(const float *partial, int64_t chunks, int64_t chunk_stride, void *out, int64_t seq,
                        int64_t h0, int64_t num_heads_out, int64_t num_heads, int64_t head_dim, int dtype,
                        const float *sinks) {
    for (int64_t h = 0; h < num_heads_out; h++) {
        const float *head = partial + h * (head_dim + 2);
        float max_score = -3.0e38f, sum = 0.0f, acc[head_dim];
        for (int64_t c = 0; c < chunks; c++)
            max_score = head[c * chunk_stride] > max_score ? head[c * chunk_stride] : max_score;
        const float sink = sinks != NULL ? sinks[h0 + h] : 0.0f;
        if (sinks != NULL && sink > max_score) max_score = sink;
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *p = head + c * chunk_stride;
            const float w = expf(p[0] - max_score);
            sum += w * p[1];
            for (int64_t d = 0; d < head_dim; d++) acc[d] += w * p[2 + d];
        }
        if (sinks != NULL) sum += expf(sink - max_score);
        const float inv_sum = 1.0f / sum;
        const int64_t index = (seq * num_heads + h0 + h) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            if (dtype == DTYPE_F32) ((float *)out)[index + d] = acc[d] * inv_sum;
            else ((uint16_t *)out)[index + d] = f32_to_bf16(acc[d] * inv_sum);
        }
    }
}

/* The sequence that chunk `chunk` belongs to: chunk_start[seq] <= chunk < chunk_start[seq + 1]. */
static int64_t chunk_sequence(const int64_t *chunk_start, int64_t num_seqs, int64_t chunk) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Keys [*first, *end) of chunk `chunk` of sequence `seq` (all of them when it is not split). */
static void chunk_keys(const decode_split *split, const int64_t *seq_lens, int64_t window,
                       int64_t seq, int64_t chunk, int64_t *first, int64_t *end) {
    const int64_t len = seq_lens[seq], size = split->chunk_keys;
    *first = first_key(len, window) + (chunk - split->chunk_start[seq]) * size;
    *end = *first + size < len ? *first + size : len;
}

/* The attention of a decode batch, shared among the threads of the enclosing parallel region (a
 * loop of `team`'s, common.h, then an orphaned `omp for` that merges split sequences). split:
 * from plan_decode_split(), for the same batch and number of threads. scratch:
 * attention_scratch_floats() for this thread, or NULL when its allocation failed (the thread's
 * tasks are then skipped; the caller reports it). */
static void attention_tasks_sinks(
        task_team *team, const void *q, const void *k_cache, const void *v_cache, void *out,
        const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs, int64_t max_blocks,
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
        float scale, float softcap, int dtype, int num_threads, float *scratch, const decode_split *split,
        const float *sinks) {
    /* Whole chunks (all kv heads) per task when there are enough of them to keep every thread
     * busy; then each thread's share is a run of consecutive chunks, so that it knows its next
     * chunk and can request it early. Against the round-robin static loop before, 12 layers'
     * caches of shuffled blocks and uneven lengths, alternating over 31 rounds (Zen 3): 64
     * sequences of up to 288 keys fp32 1.02-1.03x, bf16 1.04x; 16 x 1,024 fp32 1.06x; 4 x 4,096
     * bf16 1.15x; one sequence even. */
    const int64_t *chunk_start = split->chunk_start;
    float *partials = split->partials;
    const int64_t num_chunks = chunk_start[num_seqs];
    const int64_t kv_per_task = num_chunks >= SMALL_BATCH_TASKS * num_threads ? num_kv_heads : 1;
    const int64_t tasks_per_chunk = num_kv_heads / kv_per_task, group = num_heads / num_kv_heads;
    const int64_t row_bytes = num_kv_heads * head_dim * kv_elem_size(dtype);
    const int64_t partial_floats = head_dim + 2;
    const attend_fn attend = choose_kernel(head_dim, dtype);
    const int64_t tasks = num_chunks * tasks_per_chunk;
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t share_end = tasks * (me + 1) / threads;
    open_share(team, tasks * me / threads, share_end);
    int stolen = 0;
    int64_t task;
    while (next_task(team, &stolen, &task)) {
        const int64_t chunk = task / tasks_per_chunk, following = chunk + 1;
        const int64_t seq = chunk_sequence(chunk_start, num_seqs, chunk);
        int64_t first, end;
        chunk_keys(split, seq_lens, window, seq, chunk, &first, &end);
        next_sequence next = {.remaining = 0};
        if (kv_per_task == num_kv_heads && !stolen && task + 1 < share_end) {
            const int64_t next_seq = chunk_sequence(chunk_start, num_seqs, following);
            int64_t next_first, next_end;
            chunk_keys(split, seq_lens, window, next_seq, following, &next_first, &next_end);
            const int64_t first_block = next_first / block_size;
            const int64_t end_block = (next_end + block_size - 1) / block_size;
            const int64_t block_bytes = block_size * row_bytes;
            /* Only the rows of keys [next_first, next_end), not the whole first and last blocks:
             * with vLLM's CPU default of 128-token blocks a last block holds 64 unused rows on
             * average, which would be read from memory for nothing. */
            const int64_t first_offset = next_first % block_size * row_bytes / 64 * 64;
            const int64_t last_end = ((next_end - 1) % block_size + 1) * row_bytes;
            const int64_t all_lines = 2 * ((end_block - first_block) * block_bytes - first_offset
                                           - (block_bytes - last_end) + 63) / 64;
            const int64_t lines = all_lines < NEXT_SEQUENCE_BYTES / 64 ? all_lines : NEXT_SEQUENCE_BYTES / 64;
            const int64_t tiles = 2 * ((end - first + 15) / 16);  /* key and value tiles */
            if (next_end > next_first)
                next = (next_sequence){
                    .caches = {k_cache, v_cache},
                    .block_table = block_tables + next_seq * max_blocks,
                    .first_block = first_block, .end_block = end_block, .block_bytes = block_bytes,
                    .first_offset = first_offset, .last_end = last_end,
                    .lines_per_tile = (lines + tiles - 1) / tiles, .remaining = lines,
                    .cache = 0, .block = first_block, .cursor = NULL, .end = NULL,
                };
        }
        const int64_t kv_first = (task % tasks_per_chunk) * kv_per_task, h0 = kv_first * group;
        const int is_split = chunk_start[seq + 1] - chunk_start[seq] > 1;
        /* A split sequence's chunks go to partials, merged below; a whole one's straight out. */
        float *partial = is_split ? partials + (chunk * num_heads + h0) * partial_floats : scratch;
        if (scratch != NULL && end > first) {
            attend(q, k_cache, v_cache, block_tables + seq * max_blocks, first, end, seq, kv_first,
                   kv_per_task, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, dtype,
                   scratch + num_heads * partial_floats, &next, partial);
            if (!is_split)
                write_heads(partial, 1, 0, out, seq, h0, kv_per_task * group, num_heads, head_dim,
                            q_dtype_of(dtype), sinks);
        }
    }
#pragma omp barrier
    if (num_chunks == num_seqs) return;  /* nothing split: nothing to merge */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_seqs * num_heads; i++) {
        const int64_t seq = i / num_heads, h = i % num_heads;
        const int64_t chunks = chunk_start[seq + 1] - chunk_start[seq];
        if (chunks > 1)
            write_heads(partials + (chunk_start[seq] * num_heads + h) * partial_floats, chunks,
                        num_heads * partial_floats, out, seq, h, 1, num_heads, head_dim, q_dtype_of(dtype),
                        sinks);
    }
}

void attention_tasks(task_team *team, const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                     int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t window, float scale, float softcap, int dtype,
                     int num_threads, float *scratch, const decode_split *split) {
    attention_tasks_sinks(team, q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs, max_blocks,
                          num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, dtype,
                          num_threads, scratch, split, NULL);
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a bad argument. sinks:
 * num_heads fp32 logits (gpt-oss's), or NULL (the other families: the arithmetic without sinks). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                           int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, float scale,
                           float softcap, int dtype, int num_threads, const float *sinks) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || !valid_cache_dtype(dtype)) return 2;
    const int64_t scratch_floats =
        attention_scratch_floats(max_seq_len(seq_lens, num_seqs), num_heads, head_dim);
    decode_split split;
    if (plan_decode_split(seq_lens, num_seqs, window, num_heads, head_dim, num_threads, &split) != 0)
        return 1;
    int failed = 0;
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = thread_scratch(scratch_floats, &failed);
        task_team team = team_of(shares);
        attention_tasks_sinks(&team, q, k_cache, v_cache, out, block_tables, seq_lens, num_seqs, max_blocks,
                              num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, dtype,
                              num_threads, scratch, &split, sinks);
        free(scratch);
    }
    free_decode_split(&split);
    return failed;
}

/*
 * Paged attention for prefill chunks (many new query tokens per sequence), on the CPU with
 * AVX-512 or AVX2: FlashAttention's tiling (Dao et al. 2022, arXiv 2205.14135, Algorithm 1) over
 * the paged cache. A task is one (chunk, kv head, block of PREFILL_QUERIES query positions); its
 * rows are those positions times the query heads that share the kv head (GQA without copying
 * keys), so a tile of keys and values, read from the cache once, serves all of them. Per tile of
 * PREFILL_KEYS keys: S = Q K^T (the keys packed transposed, fp32), the causal and window masks,
 * the online softmax (running max and sum per row, the accumulator rescaled when the max grows),
 * then O += P V. Only tiles a row can see are visited, so a causal prefill computes about half of
 * the square, as FlashAttention does. With bf16 inputs on a CPU with AVX512-BF16 both products
 * take bf16 pairs through vdpbf16ps (fp32 sums; on AMX tiles where the CPU has them), the probabilities rounded to bf16 for P V as
 * FlashAttention and PyTorch's CPU flash attention round them; elsewhere bf16 is widened to fp32
 * when packed and the arithmetic is fp32. The queries of chunk c are the last chunk_lens[c] of
 * its seq_lens[c] positions (their keys already written to the cache), at rows chunk_rows[c] of q
 * and out: out (rows, num_heads, head_dim), q rows of num_heads x head_dim values q_stride
 * elements apart (the queries where the fused q/k/v product left them). An fp8 cache (bits 4-7 of
 * dtype, as for the decode kernel) is widened tile by tile through the decode kernel's reader
 * (stage_fp8_tile). head_dim 64, 128 or 256. A soft
 * cap (softcap > 0) applies to each row's visible scores of a tile before its max is taken.
 */
/* Query blocks of 64 ran 5-15% faster than blocks of 32 (each key tile packed for more rows) and
 * than blocks of 128 below 2048 tokens (benchmarks/prefill_attention.py, bf16). */
enum { PREFILL_QUERIES = 64, PREFILL_KEYS = 64 };

int has_prefill_attention(int64_t head_dim) {
#if defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
    (void)head_dim;
    return 0;
#endif
}

#if defined(__AVX512F__)
/* s[r][0:64] = q[r][0:D] . kt[0:D][0:64] for ROWS rows (q rows D apart, s rows 64 apart). */
#define SCORE_KERNEL(ROWS)                                                                      \
    static void score_kernel_##ROWS(const float *q, const float *kt, float *s, int64_t D) {     \
        __m512 acc[ROWS][4];                                                                    \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                        \
        for (int64_t d = 0; d < D; d++) {                                                       \
            const float *k = kt + d * PREFILL_KEYS;                                             \
            const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16),                 \
                         k2 = _mm512_loadu_ps(k + 32), k3 = _mm512_loadu_ps(k + 48);            \
            for (int r = 0; r < ROWS; r++) {                                                    \
                const __m512 b = _mm512_set1_ps(q[r * D + d]);                                  \
                acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);                                  \
                acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);                                  \
                acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);                                  \
                acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);                                  \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(s + r * PREFILL_KEYS + 16 * j, acc[r][j]); \
    }
SCORE_KERNEL(1) SCORE_KERNEL(2) SCORE_KERNEL(3) SCORE_KERNEL(4) SCORE_KERNEL(5)
#undef SCORE_KERNEL
typedef void (*score_kernel_fn)(const float *, const float *, float *, int64_t);
static const score_kernel_fn score_kernels[6] = {
    NULL, score_kernel_1, score_kernel_2, score_kernel_3, score_kernel_4, score_kernel_5};

/* o[r][0:16 VECS] += p[r][0:n] . v[0:n][0:16 VECS] for ROWS rows (p rows 64 apart, o and v
 * rows D apart: 16 VECS columns of them). */
#define VALUE_KERNEL(ROWS, VECS)                                                                \
    static void value_kernel_##ROWS##_##VECS(const float *p, const float *v, float *o, int64_t n, \
                                             int64_t D) {                                       \
        __m512 acc[ROWS][VECS];                                                                 \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < VECS; j++) acc[r][j] = _mm512_loadu_ps(o + r * D + 16 * j);    \
        for (int64_t t = 0; t < n; t++) {                                                       \
            __m512 vv[VECS];                                                                    \
            for (int j = 0; j < VECS; j++) vv[j] = _mm512_loadu_ps(v + t * D + 16 * j);         \
            for (int r = 0; r < ROWS; r++) {                                                    \
                const __m512 b = _mm512_set1_ps(p[r * PREFILL_KEYS + t]);                       \
                for (int j = 0; j < VECS; j++) acc[r][j] = _mm512_fmadd_ps(b, vv[j], acc[r][j]); \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < VECS; j++) _mm512_storeu_ps(o + r * D + 16 * j, acc[r][j]);     \
    }
VALUE_KERNEL(1, 4) VALUE_KERNEL(2, 4) VALUE_KERNEL(3, 4) VALUE_KERNEL(4, 4) VALUE_KERNEL(5, 4)
VALUE_KERNEL(6, 4) VALUE_KERNEL(1, 8) VALUE_KERNEL(2, 8) VALUE_KERNEL(3, 8)
#undef VALUE_KERNEL
typedef void (*value_kernel_fn)(const float *, const float *, float *, int64_t, int64_t);
static const value_kernel_fn value_kernels_4[7] = {
    NULL, value_kernel_1_4, value_kernel_2_4, value_kernel_3_4, value_kernel_4_4, value_kernel_5_4,
    value_kernel_6_4};
static const value_kernel_fn value_kernels_8[4] = {
    NULL, value_kernel_1_8, value_kernel_2_8, value_kernel_3_8};

/* A tile's two fp32 products for `rows` task rows: s = q kt (q rows D apart, s rows PREFILL_KEYS
 * apart) and o += s[:, 0:n] v (v and o rows D apart). */
static void score_products(const float *q, const float *kt, float *s, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r += 5) {
        const int64_t m = rows - r < 5 ? rows - r : 5;
        score_kernels[m](q + r * D, kt, s + r * PREFILL_KEYS, D);
    }
}

static void value_products(const float *s, const float *v, float *o, int64_t rows, int64_t n, int64_t D) {
    const int64_t step = D == 64 ? 6 : 3, columns = D == 64 ? 64 : 128;  /* D = 256: two halves */
    for (int64_t c = 0; c < D; c += columns)
        for (int64_t r = 0; r < rows; r += step) {
            const int64_t m = rows - r < step ? rows - r : step;
            (D == 64 ? value_kernels_4 : value_kernels_8)[m](s + r * PREFILL_KEYS, v + c, o + r * D + c, n,
                                                             D);
        }
}

#if defined(__AVX512BF16__)
/* bf16 through vdpbf16ps, pairs of bf16 in each 32-bit word. Scores: s[r][0:16 KEYS] = scale * q[r]
 * . k for ROWS rows and the tile's first 16 KEYS keys (the rows of a diagonal tile see no further:
 * the scores past them are left as they were, and softmax_tile reads none of them), q rows as
 * stored (`pairs` words each), kt[i][t] the pair (k_t[2i], k_t[2i+1]). */
#define SCORE_KERNEL_BF16(ROWS, KEYS)                                                           \
    static void score_kernel_bf16_##ROWS##_##KEYS(const uint32_t *q, const uint32_t *kt, float *s, \
                                                  int64_t pairs, float scale) {                 \
        __m512 acc[ROWS][KEYS];                                                                 \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < KEYS; j++) acc[r][j] = _mm512_setzero_ps();                     \
        for (int64_t i = 0; i < pairs; i++) {                                                   \
            const uint32_t *k = kt + i * PREFILL_KEYS;                                          \
            __m512bh keys[KEYS];                                                                \
            for (int j = 0; j < KEYS; j++) keys[j] = (__m512bh)_mm512_loadu_si512(k + 16 * j);  \
            for (int r = 0; r < ROWS; r++) {                                                    \
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)q[r * pairs + i]);          \
                for (int j = 0; j < KEYS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, keys[j]); \
            }                                                                                   \
        }                                                                                       \
        const __m512 scales = _mm512_set1_ps(scale);                                            \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < KEYS; j++)                                                      \
                _mm512_storeu_ps(s + r * PREFILL_KEYS + 16 * j, _mm512_mul_ps(acc[r][j], scales)); \
    }
#define SCORE_KERNELS_BF16(ROWS) SCORE_KERNEL_BF16(ROWS, 1) SCORE_KERNEL_BF16(ROWS, 2) \
    SCORE_KERNEL_BF16(ROWS, 3) SCORE_KERNEL_BF16(ROWS, 4)
SCORE_KERNELS_BF16(1) SCORE_KERNELS_BF16(2) SCORE_KERNELS_BF16(3) SCORE_KERNELS_BF16(4)
SCORE_KERNELS_BF16(5) SCORE_KERNELS_BF16(6)
#undef SCORE_KERNELS_BF16
#undef SCORE_KERNEL_BF16
typedef void (*score_kernel_bf16_fn)(const uint32_t *, const uint32_t *, float *, int64_t, float);
#define SCORE_ROW(ROWS) {score_kernel_bf16_##ROWS##_1, score_kernel_bf16_##ROWS##_2, \
                         score_kernel_bf16_##ROWS##_3, score_kernel_bf16_##ROWS##_4}
static const score_kernel_bf16_fn score_kernels_bf16[7][4] = {
    {NULL}, SCORE_ROW(1), SCORE_ROW(2), SCORE_ROW(3), SCORE_ROW(4), SCORE_ROW(5), SCORE_ROW(6)};
#undef SCORE_ROW

/* Values: o[r][0:16 VECS] += sum over key pairs i of the pair (p[r][2i], p[r][2i+1]) . the pair
 * (v_2i, v_2i+1) of each column: p rows PREFILL_KEYS / 2 words apart, v[i][d] one word per
 * column, v and o rows D apart (16 VECS columns of them). */
#define VALUE_KERNEL_BF16(ROWS, VECS)                                                           \
    static void value_kernel_bf16_##ROWS##_##VECS(const uint32_t *p, const uint32_t *v, float *o, \
                                                  int64_t pairs, int64_t D) {                   \
        __m512 acc[ROWS][VECS];                                                                 \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < VECS; j++) acc[r][j] = _mm512_loadu_ps(o + r * D + 16 * j);    \
        for (int64_t i = 0; i < pairs; i++) {                                                   \
            __m512bh values[VECS];                                                              \
            for (int j = 0; j < VECS; j++)                                                      \
                values[j] = (__m512bh)_mm512_loadu_si512(v + i * D + 16 * j);                   \
            for (int r = 0; r < ROWS; r++) {                                                    \
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)p[r * PREFILL_KEYS / 2 + i]); \
                for (int j = 0; j < VECS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b, values[j]); \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int j = 0; j < VECS; j++) _mm512_storeu_ps(o + r * D + 16 * j, acc[r][j]);     \
    }
/* Two rows for D = 128: three rows' 24 accumulators, 8 value vectors and the broadcast are one
 * register more than AVX-512 has (the spill cost 10-12% at 2,048 keys). */
VALUE_KERNEL_BF16(1, 4) VALUE_KERNEL_BF16(2, 4) VALUE_KERNEL_BF16(3, 4) VALUE_KERNEL_BF16(4, 4)
VALUE_KERNEL_BF16(5, 4) VALUE_KERNEL_BF16(6, 4) VALUE_KERNEL_BF16(1, 8) VALUE_KERNEL_BF16(2, 8)
#undef VALUE_KERNEL_BF16
typedef void (*value_kernel_bf16_fn)(const uint32_t *, const uint32_t *, float *, int64_t, int64_t);
static const value_kernel_bf16_fn value_kernels_bf16_4[7] = {
    NULL, value_kernel_bf16_1_4, value_kernel_bf16_2_4, value_kernel_bf16_3_4, value_kernel_bf16_4_4,
    value_kernel_bf16_5_4, value_kernel_bf16_6_4};
static const value_kernel_bf16_fn value_kernels_bf16_8[3] = {
    NULL, value_kernel_bf16_1_8, value_kernel_bf16_2_8};
#endif
#elif defined(SLIPSTREAM_AVX2)
/* With AVX2 one micro-kernel serves both products: c[r][0:16] (+)= sum over t < k of a[r][t] *
 * b[t][0:16] for ROWS rows (rows of a, b and c lda, ldb and ldc apart), a 6 x 16 block of c in
 * 12 of the 16 vector registers, the shape of the panel kernel in cpu_ops.c. The row and column
 * loops are unrolled by pragma so that the block stays in registers. */
#define TILE_KERNEL(ROWS)                                                                       \
    static void tile_kernel_##ROWS(const float *a, int64_t lda, const float *b, int64_t ldb,   \
                                   int64_t k, float *c, int64_t ldc, int accumulate) {         \
        __m256 acc[ROWS][2];                                                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                 \
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++)                                \
                acc[r][j] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8 * j) : _mm256_setzero_ps(); \
        for (int64_t t = 0; t < k; t++) {                                                      \
            const __m256 b0 = _mm256_loadu_ps(b + t * ldb), b1 = _mm256_loadu_ps(b + t * ldb + 8); \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                           \
                const __m256 x = _mm256_broadcast_ss(a + r * lda + t);                         \
                acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);                                 \
                acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);                                 \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                 \
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++)                                \
                _mm256_storeu_ps(c + r * ldc + 8 * j, acc[r][j]);                              \
    }
TILE_KERNEL(1) TILE_KERNEL(2) TILE_KERNEL(3) TILE_KERNEL(4) TILE_KERNEL(5) TILE_KERNEL(6)
#undef TILE_KERNEL
typedef void (*tile_kernel_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                               int);
static const tile_kernel_fn tile_kernels[7] = {
    NULL, tile_kernel_1, tile_kernel_2, tile_kernel_3, tile_kernel_4, tile_kernel_5, tile_kernel_6};
enum { TILE_ROWS = 6, TILE_COLS = 16 };

/* score_products and value_products as with AVX-512: the scores of 6 rows in blocks of 16 keys
 * (q . kt over D), their values' product in blocks of 16 columns (s . v over the tile's n keys). */
static void score_products(const float *q, const float *kt, float *s, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int64_t m = rows - r < TILE_ROWS ? rows - r : TILE_ROWS;
        for (int64_t j = 0; j < PREFILL_KEYS; j += TILE_COLS)
            tile_kernels[m](q + r * D, D, kt + j, PREFILL_KEYS, D, s + r * PREFILL_KEYS + j, PREFILL_KEYS, 0);
    }
}

static void value_products(const float *s, const float *v, float *o, int64_t rows, int64_t n, int64_t D) {
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int64_t m = rows - r < TILE_ROWS ? rows - r : TILE_ROWS;
        for (int64_t c = 0; c < D; c += TILE_COLS)
            tile_kernels[m](s + r * PREFILL_KEYS, PREFILL_KEYS, v + c, D, n, o + r * D + c, D, 1);
    }
}
#endif

#if defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)
/* Row t of a cache (num_blocks, block_size, num_kv_heads, D) for kv head g, through a block table. */
static inline const char *cache_row(const void *cache, const int64_t *block_table, int64_t t,
                                    int64_t block_size, int64_t num_kv_heads, int64_t g, int64_t D,
                                    int64_t elem) {
    const int64_t slot = block_table[t / block_size] * block_size + t % block_size;
    return (const char *)cache + ((slot * num_kv_heads + g) * D) * elem;
}

/* Element offset of (token row, head) where rows of heads x D values are row_stride elements apart. */
static inline int64_t head_offset(int64_t row, int64_t head, int64_t row_stride, int64_t D) {
    return row * row_stride + head * D;
}

static inline void widen_row(const char *src, float *dst, int64_t D, int dtype, float scale) {
    if (dtype == DTYPE_F32) {
        for (int64_t d = 0; d < D; d++) dst[d] = ((const float *)src)[d] * scale;
    } else {
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(((const uint16_t *)src)[d]) * scale;
    }
}

/* A task's working memory. In bf16 q, kt, v and p hold bf16 pairs (the arithmetic's inputs), in
 * fp32 q, kt and v fp32 values and p is unused; s, o, max and sum are fp32 either way. stage (an
 * fp8 cache only) holds a tile's keys, then its values, widened to the queries' dtype (bf16
 * queries without AVX512-BF16: bf16 there, which pack_tile_f32 widens again as from a bf16 cache). */
typedef struct {
    float *q, *o, *s, *kt, *v, *max, *sum;
    uint32_t *p;
    float *stage;
} prefill_scratch;

static int64_t prefill_scratch_floats(int64_t rows, int64_t D, int fp8) {
    return 2 * rows * D + rows * PREFILL_KEYS + 2 * PREFILL_KEYS * D + 2 * rows + rows * PREFILL_KEYS / 2
           + (fp8 ? 2 * PREFILL_KEYS * D : 0);
}

static prefill_scratch split_prefill_scratch(float *base, int64_t rows, int64_t D) {
    prefill_scratch s = {.q = base};
    s.o = s.q + rows * D;
    s.s = s.o + rows * D;
    s.kt = s.s + rows * PREFILL_KEYS;
    s.v = s.kt + PREFILL_KEYS * D;
    s.max = s.v + PREFILL_KEYS * D;
    s.sum = s.max + rows;
    s.p = (uint32_t *)(s.sum + rows);
    s.stage = (float *)(s.p + rows * PREFILL_KEYS / 2);
    return s;
}

/* Rows [j0, j0 + n) of an fp8 cache (dtype: bits 0-3 the queries' fp32 or bf16, bits 4-7 the
 * cache's) for kv head g widened into w.stage, keys then values, each row D values after the last:
 * through the decode kernel's reader (load_cache16, load8), and to bf16 by dropping the low
 * half of the fp32 bits, which is exact (every e4m3 and e5m2 value has a 2-4 bit significand). The
 * tile packers then read the stage as a cache of one head in one block (stage_table). */
static void stage_fp8_tile(const void *k_cache, const void *v_cache, const int64_t *block_table, int64_t j0,
                           int64_t n, int64_t g, int64_t num_kv_heads, int64_t D, int64_t block_size, int dtype,
                           prefill_scratch w) {
    const int bf16 = q_dtype_of(dtype) == DTYPE_BF16;
    float row[D];
    for (int64_t half = 0; half < 2; half++) {
        const void *cache = half == 0 ? k_cache : v_cache;
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = block_table[(j0 + t) / block_size] * block_size + (j0 + t) % block_size;
            const int64_t index = (slot * num_kv_heads + g) * D, at = (half * PREFILL_KEYS + t) * D;
#if defined(__AVX512F__)
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(row + d, load_cache16(cache, index + d, dtype));
#else
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(row + d, load8(cache, index + d, dtype));
#endif
            if (!bf16) {
                memcpy(w.stage + at, row, D * sizeof(float));
                continue;
            }
            for (int64_t d = 0; d < D; d++) {
                union { float f; uint32_t u; } bits = {.f = row[d]};
                ((uint16_t *)w.stage)[at + d] = (uint16_t)(bits.u >> 16);
            }
        }
    }
}

static const int64_t stage_table[1] = {0};

/* fp32 arithmetic: keys [j0, j0 + n) widened into w.kt transposed (kt[d][t]) and w.v (v[t][d]),
 * zeros past n. */
static void pack_tile_f32(const void *k_cache, const void *v_cache, const int64_t *block_table,
                          int64_t j0, int64_t n, int64_t g, int64_t num_kv_heads, int64_t D,
                          int64_t block_size, int dtype, prefill_scratch w) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t t = 0; t < PREFILL_KEYS; t++) {
        float *v = w.v + t * D;
        if (t >= n) {
            memset(v, 0, D * sizeof(float));
            for (int64_t d = 0; d < D; d++) w.kt[d * PREFILL_KEYS + t] = 0.0f;
            continue;
        }
        widen_row(cache_row(v_cache, block_table, j0 + t, block_size, num_kv_heads, g, D, elem), v, D, dtype,
                  1.0f);
        const char *k = cache_row(k_cache, block_table, j0 + t, block_size, num_kv_heads, g, D, elem);
        for (int64_t d = 0; d < D; d++)
            w.kt[d * PREFILL_KEYS + t] = dtype == DTYPE_F32 ? ((const float *)k)[d]
                                                            : bf16_to_f32(((const uint16_t *)k)[d]);
    }
}

#if defined(__AVX512BF16__)
/* rows[c] = column c of the 16 x 16 matrix of 32-bit words rows[0:16]: pairs of rows interleaved
 * word by word, then pairs of words, then 128-bit lanes across rows 4 and 8 apart. */
static inline void transpose_16x16(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* rows[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j */
        rows[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        rows[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        rows[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        rows[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_i32x4(rows[j], rows[4 + j], 0x88);       /* lanes 0, 2 */
        t[4 + j] = _mm512_shuffle_i32x4(rows[j], rows[4 + j], 0xDD);   /* lanes 1, 3 */
        t[8 + j] = _mm512_shuffle_i32x4(rows[8 + j], rows[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(rows[8 + j], rows[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; j++) {
        rows[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        rows[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
        rows[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
        rows[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xDD);
    }
}

/* bf16 arithmetic: keys [j0, j0 + n) as pairs, kt[i][t] = (k_t[2i], k_t[2i+1]) and
 * v[i][d] = (v_2i[d], v_2i+1[d]), zeros past n (unwritten cache slots may hold anything, and
 * 0 * NaN would reach the output). */
static void pack_tile_bf16(const void *k_cache, const void *v_cache, const int64_t *block_table,
                           int64_t j0, int64_t n, int64_t g, int64_t num_kv_heads, int64_t D,
                           int64_t block_size, prefill_scratch w) {
    uint32_t *kt = (uint32_t *)w.kt, *v = (uint32_t *)w.v;
    const int64_t pairs = D / 2;
    for (int64_t t0 = 0; t0 < PREFILL_KEYS; t0 += 16) {  /* 16 keys x 16 pairs at a time, transposed */
        const uint32_t *keys[16];
        for (int64_t e = 0; e < 16; e++)
            keys[e] = t0 + e < n ? (const uint32_t *)cache_row(k_cache, block_table, j0 + t0 + e, block_size,
                                                               num_kv_heads, g, D, 2)
                                 : NULL;
        for (int64_t i0 = 0; i0 < pairs; i0 += 16) {
            __m512i rows[16];
            for (int e = 0; e < 16; e++)
                rows[e] = keys[e] == NULL ? _mm512_setzero_si512() : _mm512_loadu_si512(keys[e] + i0);
            transpose_16x16(rows);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(kt + (i0 + c) * PREFILL_KEYS + t0, rows[c]);
        }
    }
    for (int64_t i = 0; i < PREFILL_KEYS / 2; i++) {
        const uint16_t *rows[2];  /* keys 2i and 2i + 1, NULL past n */
        for (int e = 0; e < 2; e++)
            rows[e] = 2 * i + e < n ? (const uint16_t *)cache_row(v_cache, block_table, j0 + 2 * i + e,
                                                                  block_size, num_kv_heads, g, D, 2)
                                    : NULL;
        for (int64_t d = 0; d < D; d += 16) {
            __m512i words[2];
            for (int e = 0; e < 2; e++)
                words[e] = rows[e] == NULL ? _mm512_setzero_si512()
                    : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rows[e] + d)));
            _mm512_storeu_si512(v + i * D + d, _mm512_or_si512(words[0], _mm512_slli_epi32(words[1], 16)));
        }
    }
}

/* Row r of p (fp32, PREFILL_KEYS values) as bf16 pairs, the rounding FlashAttention applies before
 * its P V product; the softmax's sums stay fp32. */
static void pair_probabilities(const float *s, uint32_t *p, int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < PREFILL_KEYS; j += 32)
            _mm512_storeu_si512(p + r * PREFILL_KEYS / 2 + j / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * PREFILL_KEYS + j + 16),
                                                             _mm512_loadu_ps(s + r * PREFILL_KEYS + j)));
}
#endif

#if defined(SLIPSTREAM_AMX)
/* Both bf16 products of a tile on AMX tiles (common.h), 16 task rows at a time: the packed keys
 * (kt) and values (v) are already B tiles' layout (pairs of consecutive k, here d for the keys and
 * keys for the values, side by side), q and p rows are A tiles. Tiles 0-3 hold four 16-column
 * blocks of the sums, 4 the rows of q or p, 5-7 the keys or values. Past the tile's n keys kt, v
 * and p are zero, so every product runs over all PREFILL_KEYS. */
enum { AMX_TILE_ROWS = 16 };

static void configure_prefill_tiles(int64_t rows, int64_t *configured) {
    if (rows != *configured) configure_amx(*configured = rows, 4, 1, 3);
}

/* s[r][0:64] = scale * q[r] . k for the task's rows (q rows D bf16 apart). */
static void amx_scores(const uint16_t *q, const uint32_t *kt, float *s, int64_t rows, int64_t D, float scale,
                       int64_t *configured) {
    for (int64_t r0 = 0; r0 < rows; r0 += AMX_TILE_ROWS) {
        const int64_t m = rows - r0 < AMX_TILE_ROWS ? rows - r0 : AMX_TILE_ROWS;
        configure_prefill_tiles(m, configured);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const uint32_t *k = kt + d0 / 2 * PREFILL_KEYS;  /* pairs d0 / 2 on, 16 rows */
            _tile_loadd(4, q + r0 * D + d0, D * sizeof(uint16_t));
            _tile_loadd(5, k, PREFILL_KEYS * sizeof(uint32_t));
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, k + 16, PREFILL_KEYS * sizeof(uint32_t));
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, k + 32, PREFILL_KEYS * sizeof(uint32_t));
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, k + 48, PREFILL_KEYS * sizeof(uint32_t));
            _tile_dpbf16ps(3, 4, 5);
        }
        float *out = s + r0 * PREFILL_KEYS;
        _tile_stored(0, out, PREFILL_KEYS * sizeof(float));
        _tile_stored(1, out + 16, PREFILL_KEYS * sizeof(float));
        _tile_stored(2, out + 32, PREFILL_KEYS * sizeof(float));
        _tile_stored(3, out + 48, PREFILL_KEYS * sizeof(float));
        const __m512 scales = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < m * PREFILL_KEYS; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), scales));
    }
}

/* o[r] += p[r] . v for the task's rows (p rows PREFILL_KEYS / 2 words apart, o rows D floats). */
static void amx_values(const uint32_t *p, const uint32_t *v, float *o, int64_t rows, int64_t D,
                       int64_t *configured) {
    for (int64_t r0 = 0; r0 < rows; r0 += AMX_TILE_ROWS) {
        const int64_t m = rows - r0 < AMX_TILE_ROWS ? rows - r0 : AMX_TILE_ROWS;
        configure_prefill_tiles(m, configured);
        for (int64_t c0 = 0; c0 < D; c0 += 64) {  /* four 16-column blocks of o at a time */
            float *acc = o + r0 * D + c0;
            _tile_loadd(0, acc, D * sizeof(float));
            _tile_loadd(1, acc + 16, D * sizeof(float));
            _tile_loadd(2, acc + 32, D * sizeof(float));
            _tile_loadd(3, acc + 48, D * sizeof(float));
            for (int64_t t0 = 0; t0 < PREFILL_KEYS; t0 += 32) {
                const uint32_t *pairs = v + t0 / 2 * D + c0;  /* key pairs t0 / 2 on, 16 rows */
                _tile_loadd(4, p + r0 * PREFILL_KEYS / 2 + t0 / 2, PREFILL_KEYS / 2 * sizeof(uint32_t));
                _tile_loadd(5, pairs, D * sizeof(uint32_t));
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, pairs + 16, D * sizeof(uint32_t));
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, pairs + 32, D * sizeof(uint32_t));
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, pairs + 48, D * sizeof(uint32_t));
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, acc, D * sizeof(float));
            _tile_stored(1, acc + 16, D * sizeof(float));
            _tile_stored(2, acc + 32, D * sizeof(float));
            _tile_stored(3, acc + 48, D * sizeof(float));
        }
    }
}
#endif

/* How many of a tile's first keys (from j0, n in all) task row r (position p0 + r / group) may
 * see: its position's, at least 1 (a row before the tile sees none of it) and at most n. */
static inline int64_t reach_of(int64_t p0, int64_t r, int64_t group, int64_t j0, int64_t n) {
    const int64_t reach = p0 + r / group - j0 + 1;
    return reach < 1 ? 1 : reach < n ? reach : n;
}

#if defined(__AVX512F__)
/* The lanes of a 16-key chunk that hold keys [lo, hi), both relative to the chunk's first key. */
static inline __mmask16 key_mask(int64_t lo, int64_t hi) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}
#endif

/* The soft cap (where softcap > 0), the causal and window masks and the online softmax over one
 * tile's scores (keys [j0, j0 + n)): each row's scores become its probabilities against the
 * running max, which, with the running sum and the row's accumulator, is brought up to date. */
static WIDE_VECTORS void softmax_tile(prefill_scratch w, int64_t rows, int64_t group, int64_t p0, int64_t j0,
                                      int64_t n, int64_t window, float softcap, int64_t D) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t position = p0 + r / group;
        const int64_t begin = window > 0 && position - window + 1 > j0 ? position - window + 1 - j0 : 0;
        const int64_t end = position - j0 + 1 < n ? position - j0 + 1 : n;  /* keys [begin, end) */
        float *s = w.s + r * PREFILL_KEYS;
        if (begin >= end) {
            memset(s, 0, PREFILL_KEYS * sizeof(float));
            continue;
        }
        if (softcap > 0.0f) soft_cap(s + begin, end - begin, softcap);
        float sum = 0.0f, new_max;
#if defined(__AVX512F__)
        /* Only the 16-key chunks that hold keys [begin, end): the scores past them were not
         * computed (reach_of) and their probabilities are zeros. */
        const int64_t c0 = begin / 16 * 16, c1 = (end + 15) / 16 * 16;
        __m512 maxima = _mm512_set1_ps(-FLT_MAX);
        for (int64_t t = c0; t < c1; t += 16)
            maxima = _mm512_mask_max_ps(maxima, key_mask(begin - t, end - t), maxima, _mm512_loadu_ps(s + t));
        const float tile_max = _mm512_reduce_max_ps(maxima);
        new_max = tile_max > w.max[r] ? tile_max : w.max[r];
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < PREFILL_KEYS; t += 16) {
            __m512 e = _mm512_setzero_ps();
            if (t >= c0 && t < c1)
                e = _mm512_maskz_mov_ps(key_mask(begin - t, end - t),
                                        exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(new_max))));
            _mm512_storeu_ps(s + t, e);
            total = _mm512_add_ps(total, e);
        }
        sum = _mm512_reduce_add_ps(total);
#else
        float tile_max = -FLT_MAX;
        for (int64_t t = begin; t < end; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
        new_max = tile_max > w.max[r] ? tile_max : w.max[r];
        for (int64_t t = 0; t < PREFILL_KEYS; t++) {
            const float e = expf(s[t] - new_max);
            s[t] = t >= begin && t < end ? e : 0.0f;
            sum += s[t];
        }
#endif
        /* The row's running sum and accumulator in terms of the new max; nothing to rescale before
         * the row's first keys (both are zeros) or when the max stays. */
        const float correction = w.max[r] == -FLT_MAX || w.max[r] == new_max ? 1.0f : expf(w.max[r] - new_max);
        w.max[r] = new_max;
        w.sum[r] = w.sum[r] * correction + sum;
        if (correction != 1.0f)
            for (int64_t d = 0; d < D; d++) w.o[r * D + d] *= correction;
    }
}

/* One task: query positions [p0, p0 + count) of a chunk, kv head g, `group` query heads each. */
static void prefill_task(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         void *out, const int64_t *block_table, int64_t row0, int64_t first_position,
                         int64_t p0, int64_t count, int64_t g, int64_t group, int64_t num_heads,
                         int64_t num_kv_heads, int64_t D, int64_t block_size, int64_t window,
                         float scale, float softcap, int cache_dtype, const float *sinks, prefill_scratch w) {
    const int dtype = q_dtype_of(cache_dtype);
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2, rows = count * group;
#if defined(__AVX512BF16__)
    const int bf16 = dtype == DTYPE_BF16;
#else
    const int bf16 = 0;
#endif
#if defined(SLIPSTREAM_AMX)
    const int amx = bf16 && amx_granted();
    int64_t configured = 0;  /* the rows the tiles are configured for; 0 before the first */
#endif
    /* Task row i * group + h: position p0 + i (flat row first_row + i of q and out), query head
     * g * group + h. bf16 queries stay as they are, the scale applied to the scores. */
    const int64_t first_row = row0 + p0 - first_position;
    for (int64_t i = 0; i < count; i++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t r = i * group + h, offset = head_offset(first_row + i, g * group + h, q_stride, D);
            const char *src = (const char *)q + offset * elem;
            if (bf16) memcpy((uint16_t *)w.q + r * D, src, D * sizeof(uint16_t));
            else widen_row(src, w.q + r * D, D, dtype, scale);
        }
    memset(w.o, 0, rows * D * sizeof(float));
    for (int64_t r = 0; r < rows; r++) w.max[r] = -FLT_MAX, w.sum[r] = 0.0f;
    const int64_t last = p0 + count - 1;
    const int64_t lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    for (int64_t j0 = lo; j0 <= last; j0 += PREFILL_KEYS) {
        const int64_t n = last - j0 + 1 < PREFILL_KEYS ? last - j0 + 1 : PREFILL_KEYS;
        /* The tile as the packers read it: in the cache, or its fp8 rows widened into the stage. */
        const void *keys = k_cache, *values = v_cache;
        const int64_t *table = block_table;
        int64_t first = j0, heads = num_kv_heads, head = g, tile_block = block_size;
        if (cache_dtype >> 4) {
            stage_fp8_tile(k_cache, v_cache, block_table, j0, n, g, num_kv_heads, D, block_size, cache_dtype, w);
            keys = w.stage;
            values = (const char *)w.stage + PREFILL_KEYS * D * elem;
            table = stage_table, first = 0, heads = 1, head = 0, tile_block = PREFILL_KEYS;
        }
#if defined(__AVX512BF16__)
        if (bf16) {
            pack_tile_bf16(keys, values, table, first, n, head, heads, D, tile_block, w);
#if defined(SLIPSTREAM_AMX)
            if (amx) {
                amx_scores((const uint16_t *)w.q, (const uint32_t *)w.kt, w.s, rows, D, scale, &configured);
                softmax_tile(w, rows, group, p0, j0, n, window, softcap, D);
                pair_probabilities(w.s, w.p, rows);
                amx_values(w.p, (const uint32_t *)w.v, w.o, rows, D, &configured);
                continue;
            }
#endif
            /* Row r sees keys up to its position: a block of rows needs the keys its last row
             * sees, fewer than n on the diagonal tile (16 at a time for the scores, pairs for the
             * values; the probabilities past a row's last key are zeros). */
            for (int64_t r = 0; r < rows; r += 6) {
                const int64_t m = rows - r < 6 ? rows - r : 6;
                const int64_t reach = reach_of(p0, r + m - 1, group, j0, n);
                score_kernels_bf16[m][(reach + 15) / 16 - 1](
                    (const uint32_t *)w.q + r * D / 2, (const uint32_t *)w.kt, w.s + r * PREFILL_KEYS, D / 2,
                    scale);
            }
            softmax_tile(w, rows, group, p0, j0, n, window, softcap, D);
            pair_probabilities(w.s, w.p, rows);
            const int64_t step = D == 64 ? 6 : 2, columns = D == 64 ? 64 : 128;  /* D = 256: two halves */
            for (int64_t c = 0; c < D; c += columns)
                for (int64_t r = 0; r < rows; r += step) {
                    const int64_t m = rows - r < step ? rows - r : step;
                    const int64_t pairs = (reach_of(p0, r + m - 1, group, j0, n) + 1) / 2;
                    (D == 64 ? value_kernels_bf16_4 : value_kernels_bf16_8)[m](
                        w.p + r * PREFILL_KEYS / 2, (const uint32_t *)w.v + c, w.o + r * D + c, pairs, D);
                }
            continue;
        }
#endif
        pack_tile_f32(keys, values, table, first, n, head, heads, D, tile_block, dtype, w);
        score_products(w.q, w.kt, w.s, rows, D);
        softmax_tile(w, rows, group, p0, j0, n, window, softcap, D);
        value_products(w.s, w.v, w.o, rows, n, D);
    }
#if defined(SLIPSTREAM_AMX)
    if (configured) _tile_release();
#endif
    for (int64_t i = 0; i < count; i++)
        for (int64_t h = 0; h < group; h++) {
            const int64_t r = i * group + h;
            char *dst = (char *)out + head_offset(first_row + i, g * group + h, num_heads * D, D) * elem;
            float inv = 1.0f / w.sum[r];
            if (sinks != NULL) {  /* the sink's exp(sink - max) in the sum, rescaled where it is the max */
                const float sink = sinks[g * group + h], max_score = w.max[r];
                const float shrink = sink > max_score ? expf(max_score - sink) : 1.0f;
                inv = shrink / (w.sum[r] * shrink + (sink > max_score ? 1.0f : expf(sink - max_score)));
            }
            for (int64_t d = 0; d < D; d++) {
                const float value = w.o[r * D + d] * inv;
                if (dtype == DTYPE_F32) ((float *)dst)[d] = value;
                else ((uint16_t *)dst)[d] = f32_to_bf16(value);
            }
        }
}
#endif

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a bad argument. sinks:
 * num_heads fp32 logits (gpt-oss's), or NULL (the other families: the arithmetic without sinks). */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            void *out, const int64_t *chunk_rows, const int64_t *chunk_lens,
                            const int64_t *seq_lens, const int64_t *block_tables, int64_t num_chunks,
                            int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, float softcap, int dtype,
                            int num_threads, const float *sinks) {
#if defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)
    if (!has_prefill_attention(head_dim) || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
        !valid_cache_dtype(dtype))
        return 2;
    for (int64_t c = 0; c < num_chunks; c++)
        if (chunk_lens[c] < 1 || chunk_lens[c] > seq_lens[c]) return 2;
    const int64_t group = num_heads / num_kv_heads, rows = PREFILL_QUERIES * group;
    int64_t tasks = 0;  /* per chunk, per kv head: its query blocks */
    for (int64_t c = 0; c < num_chunks; c++)
        tasks += num_kv_heads * ((chunk_lens[c] + PREFILL_QUERIES - 1) / PREFILL_QUERIES);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *base = thread_scratch(prefill_scratch_floats(rows, head_dim, dtype >> 4), &failed);
        const prefill_scratch w = base == NULL ? (prefill_scratch){0}
                                               : split_prefill_scratch(base, rows, head_dim);
        /* Dynamic: a block late in a long chunk sees more keys than an early one. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t c = 0, rest = task, blocks = 0;
            for (;; c++) {
                blocks = (chunk_lens[c] + PREFILL_QUERIES - 1) / PREFILL_QUERIES;
                if (rest < num_kv_heads * blocks) break;
                rest -= num_kv_heads * blocks;
            }
            /* Later query blocks first within a chunk: the longest tasks start earliest. */
            const int64_t g = rest % num_kv_heads, b = blocks - 1 - rest / num_kv_heads;
            const int64_t first_position = seq_lens[c] - chunk_lens[c];
            const int64_t p0 = first_position + b * PREFILL_QUERIES;
            const int64_t count = seq_lens[c] - p0 < PREFILL_QUERIES ? seq_lens[c] - p0 : PREFILL_QUERIES;
            if (base != NULL)
                prefill_task(q, q_stride, k_cache, v_cache, out, block_tables + c * max_blocks,
                             chunk_rows[c], first_position, p0, count, g, group, num_heads, num_kv_heads,
                             head_dim, block_size, window, scale, softcap, dtype, sinks, w);
        }
        free(base);
    }
    return failed;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)out, (void)chunk_rows, (void)chunk_lens;
    (void)seq_lens;
    (void)block_tables, (void)num_chunks, (void)max_blocks, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)window, (void)scale, (void)softcap, (void)dtype, (void)num_threads;
    (void)sinks;
    return 2;
#endif
}
