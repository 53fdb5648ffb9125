/*
 * Paged attention for decoding sequences (one new query token each), on the CPU.
 *
 * For every (sequence, kv head) pair, in parallel: read that head's keys straight from the paged
 * cache through the block table (no gather copy), compute the scores of the G query heads that
 * share the kv head, take a softmax, and read the values once to accumulate the output. Keys and
 * values are each read exactly once, which is what bounds a decode step: the cache streams from
 * memory. fp32 and bf16 caches; bf16 is widened to fp32 for the arithmetic.
 *
 * Layouts (row-major): q and out (num_seqs, num_heads, head_dim); k_cache and v_cache
 * (num_blocks, block_size, num_kv_heads, head_dim); block_tables (num_seqs, max_blocks) int64;
 * seq_lens (num_seqs,) int64. Query head h uses kv head h / (num_heads / num_kv_heads).
 * window > 0 limits each query to its `window` most recent keys (itself included).
 *
 * Built with -ffast-math for vectorised expf and reductions, but linked without it, so the
 * library does not switch the process to flush-to-zero when it is loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline void load_row(const void *base, int64_t index, int64_t n, int dtype, float *dst) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, (const float *)base + index, n * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)base + index;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &bits, sizeof(float));
    }
}

static inline void store_row(void *base, int64_t index, int64_t n, int dtype, const float *src) {
    if (dtype == DTYPE_F32) {
        memcpy((float *)base + index, src, n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)base + index;
    for (int64_t i = 0; i < n; i++) {  /* round to nearest even, as torch does */
        uint32_t bits;
        memcpy(&bits, &src[i], sizeof(float));
        bits += 0x7FFFu + ((bits >> 16) & 1u);
        dst[i] = (uint16_t)(bits >> 16);
    }
}

/* scratch: group * (head_dim * 3 + max_len) + head_dim floats */
static void attend_one(const void *q, const void *k_cache, const void *v_cache, void *out,
                       const int64_t *block_table, int64_t seq_len, int64_t seq, int64_t kv_head,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t window, float scale, int dtype, float *scratch,
                       int64_t max_len) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    const int64_t num_keys = seq_len - first;
    float *queries = scratch;                      /* group * head_dim */
    float *acc = queries + group * head_dim;       /* group * head_dim */
    float *row = acc + group * head_dim;           /* head_dim */
    float *scores = row + head_dim;                /* group * max_len */
    (void)max_len;

    for (int64_t g = 0; g < group; g++)
        load_row(q, (seq * num_heads + kv_head * group + g) * head_dim, head_dim, dtype,
                 queries + g * head_dim);
    for (int64_t t = 0; t < num_keys; t++) {
        const int64_t pos = first + t;
        const int64_t slot = block_table[pos / block_size] * block_size + pos % block_size;
        load_row(k_cache, (slot * num_kv_heads + kv_head) * head_dim, head_dim, dtype, row);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = queries + g * head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * row[d];
            scores[g * num_keys + t] = dot * scale;
        }
    }
    float inv_sum[64];
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * num_keys;
        float max_score = s[0];  /* num_keys >= 1; no infinities: built with finite math */
        for (int64_t t = 1; t < num_keys; t++) max_score = s[t] > max_score ? s[t] : max_score;
        float sum = 0.0f;
        for (int64_t t = 0; t < num_keys; t++) {
            s[t] = expf(s[t] - max_score);
            sum += s[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    memset(acc, 0, group * head_dim * sizeof(float));
    for (int64_t t = 0; t < num_keys; t++) {
        const int64_t pos = first + t;
        const int64_t slot = block_table[pos / block_size] * block_size + pos % block_size;
        load_row(v_cache, (slot * num_kv_heads + kv_head) * head_dim, head_dim, dtype, row);
        for (int64_t g = 0; g < group; g++) {
            const float w = scores[g * num_keys + t];
            float *ag = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d++) ag[d] += w * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *ag = acc + g * head_dim;
        for (int64_t d = 0; d < head_dim; d++) ag[d] *= inv_sum[g];
        store_row(out, (seq * num_heads + kv_head * group + g) * head_dim, head_dim, dtype, ag);
    }
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a bad argument. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                           int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, float scale,
                           int dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64)
        return 2;
    int64_t max_len = 0;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t scratch_floats = group * (3 * head_dim + max_len) + head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; seq++)
            for (int64_t kv_head = 0; kv_head < num_kv_heads; kv_head++)
                if (scratch != NULL)
                    attend_one(q, k_cache, v_cache, out, block_tables + seq * max_blocks,
                               seq_lens[seq], seq, kv_head, num_heads, num_kv_heads, head_dim,
                               block_size, window, scale, dtype, scratch, max_len);
        free(scratch);
    }
    return failed;
}
