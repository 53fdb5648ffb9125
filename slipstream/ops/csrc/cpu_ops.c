/*
 * CPU kernels for the serving engine, called through ctypes (see slipstream/ops/cpu_kernels.py).
 *
 * Paged attention for decoding sequences (one new query token each). For every (sequence, kv
 * head) pair, in parallel, and for each of the query heads sharing that kv head: walk the
 * sequence's blocks through its block table and score the keys in place (no gather copy), take
 * a softmax, then walk the blocks again to accumulate the values. The cache is what a decode step
 * streams from memory; each query head after the first re-reads its kv head's rows from cache.
 *
 * Layouts (row-major): q and out (num_seqs, num_heads, head_dim); k_cache
 * (num_blocks, num_kv_heads, head_dim, block_size): each block keeps its keys transposed, so the
 * scores of a block's tokens are block_size-wide vector multiply-adds with no horizontal sums;
 * v_cache (num_blocks, block_size, num_kv_heads, head_dim); block_tables (num_seqs, max_blocks)
 * int64; seq_lens (num_seqs,) int64. Query head h uses kv head h / (num_heads / num_kv_heads).
 * window > 0 limits each query to its `window` most recent keys (itself included). fp32 and bf16
 * caches; bf16 is widened to fp32 for the arithmetic.
 *
 * Built with -ffast-math for vectorised expf and reassociated reductions, but linked without it,
 * so the library does not switch the process to flush-to-zero when it is loaded. Common head and
 * block sizes get specialised copies (constant trip counts the compiler unrolls and vectorises).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even, as torch does */
    union { float f; uint32_t u; } bits = {.f = x};
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

static inline float load(const void *base, int64_t index, int dtype) {
    return dtype == DTYPE_F32 ? ((const float *)base)[index] : bf16_to_f32(((const uint16_t *)base)[index]);
}

static inline void prefetch_rows(const void *cache, int64_t first_elem, int64_t num_elems,
                                 int dtype) {
    const int64_t elem_size = dtype == DTYPE_F32 ? 4 : 2;
    const char *begin = (const char *)cache + first_elem * elem_size;
    for (int64_t b = 0; b < num_elems * elem_size; b += 64) __builtin_prefetch(begin + b);
}

/* Scores of query q (already scaled) against one block's transposed keys kt (head_dim x
 * block_size), for the `count` slots starting at `offset`. Four partial sums over d keep four
 * independent multiply-add chains in flight. */
static inline __attribute__((always_inline)) void score_block(
        const float *q, const void *k_cache, int64_t kt_index, int64_t head_dim,
        int64_t block_size, int64_t offset, int64_t count, int dtype, float *out) {
    float acc[4][block_size];
    for (int j = 0; j < 4; j++)
        for (int64_t s = 0; s < block_size; s++) acc[j][s] = 0.0f;
    for (int64_t d = 0; d < head_dim; d += 4)
        for (int j = 0; j < 4; j++)
            for (int64_t s = 0; s < block_size; s++)
                acc[j][s] += q[d + j] * load(k_cache, kt_index + (d + j) * block_size + s, dtype);
    for (int64_t s = 0; s < count; s++)
        out[s] = acc[0][offset + s] + acc[1][offset + s] + acc[2][offset + s] + acc[3][offset + s];
}

static inline __attribute__((always_inline)) void attend_head(
        const void *q, const void *k_cache, const void *v_cache, void *out,
        const int64_t *block_table, int64_t seq_len, int64_t head_index, int64_t kv,
        int64_t num_kv_heads, const int64_t head_dim, const int64_t block_size, int64_t window,
        float scale, int dtype, float *scores) {
    const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    const int64_t num_keys = seq_len - first;
    float query[head_dim], acc[2][head_dim];
    for (int64_t d = 0; d < head_dim; d++) query[d] = load(q, head_index + d, dtype) * scale;

    float max_score = -3.0e38f;  /* finite: built with finite math */
    for (int64_t pos = first, t = 0; pos < seq_len;) {
        const int64_t block = block_table[pos / block_size];
        const int64_t offset = pos % block_size;
        const int64_t count = block_size - offset < seq_len - pos ? block_size - offset : seq_len - pos;
        if (pos + count < seq_len)  /* the next block is elsewhere in memory: ask for it now */
            prefetch_rows(k_cache, (block_table[(pos + count) / block_size] * num_kv_heads + kv)
                          * head_dim * block_size, head_dim * block_size, dtype);
        score_block(query, k_cache, (block * num_kv_heads + kv) * head_dim * block_size,
                    head_dim, block_size, offset, count, dtype, scores + t);
        for (int64_t s = 0; s < count; s++) max_score = scores[t + s] > max_score ? scores[t + s] : max_score;
        pos += count;
        t += count;
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < num_keys; i++) {
        scores[i] = expf(scores[i] - max_score);
        sum += scores[i];
    }
    for (int64_t d = 0; d < head_dim; d++) acc[0][d] = acc[1][d] = 0.0f;
    const int64_t row_stride = num_kv_heads * head_dim;
    for (int64_t pos = first, t = 0; pos < seq_len;) {
        const int64_t block = block_table[pos / block_size];
        const int64_t offset = pos % block_size;
        const int64_t count = block_size - offset < seq_len - pos ? block_size - offset : seq_len - pos;
        int64_t index = ((block * block_size + offset) * num_kv_heads + kv) * head_dim;
        if (pos + count < seq_len)
            for (int64_t s = 0; s < block_size; s++)
                prefetch_rows(v_cache, ((block_table[(pos + count) / block_size] * block_size + s)
                              * num_kv_heads + kv) * head_dim, head_dim, dtype);
        for (int64_t s = 0; s < count; s++, t++, index += row_stride) {
            const float w = scores[t];
            float *a = acc[t & 1];  /* two accumulators: independent chains for alternate keys */
            for (int64_t d = 0; d < head_dim; d++) a[d] += w * load(v_cache, index + d, dtype);
        }
        pos += count;
    }
    const float inv_sum = 1.0f / sum;
    if (dtype == DTYPE_F32) {
        float *dst = (float *)out + head_index;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = (acc[0][d] + acc[1][d]) * inv_sum;
    } else {
        uint16_t *dst = (uint16_t *)out + head_index;
        for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_bf16((acc[0][d] + acc[1][d]) * inv_sum);
    }
}

typedef void (*attend_fn)(const void *, const void *, const void *, void *, const int64_t *,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          int, float *);

#define DEFINE_ATTEND(NAME, HEAD_DIM, BLOCK_SIZE, DTYPE)                                       \
    static void NAME(const void *q, const void *k, const void *v, void *out,                  \
                     const int64_t *table, int64_t len, int64_t head_index, int64_t kv,        \
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,              \
                     int64_t window, float scale, int dtype, float *scores) {                  \
        (void)head_dim; (void)block_size; (void)dtype;                                         \
        attend_head(q, k, v, out, table, len, head_index, kv, num_kv_heads, HEAD_DIM,          \
                    BLOCK_SIZE, window, scale, DTYPE, scores);                                 \
    }
DEFINE_ATTEND(attend_f32_d64_s16, 64, 16, DTYPE_F32)
DEFINE_ATTEND(attend_f32_d128_s16, 128, 16, DTYPE_F32)
DEFINE_ATTEND(attend_bf16_d64_s16, 64, 16, DTYPE_BF16)
DEFINE_ATTEND(attend_bf16_d128_s16, 128, 16, DTYPE_BF16)
DEFINE_ATTEND(attend_any, head_dim, block_size, dtype)  /* variable-length arrays */

static attend_fn choose_kernel(int64_t head_dim, int64_t block_size, int dtype) {
    if (block_size != 16 || head_dim % 4 != 0) return attend_any;
    if (head_dim == 64) return dtype == DTYPE_F32 ? attend_f32_d64_s16 : attend_bf16_d64_s16;
    if (head_dim == 128) return dtype == DTYPE_F32 ? attend_f32_d128_s16 : attend_bf16_d128_s16;
    return attend_any;
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 for a bad argument. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                           int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, float scale,
                           int dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim % 4 != 0) return 2;
    int64_t max_len = 0;
    for (int64_t i = 0; i < num_seqs; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t group = num_heads / num_kv_heads;
    const attend_fn attend = choose_kernel(head_dim, block_size, dtype);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((max_len + block_size) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* one task per (sequence, kv head): its query heads re-read the same rows from cache */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            const int64_t seq = task / num_kv_heads, kv = task % num_kv_heads;
            if (scores == NULL || seq_lens[seq] <= 0) continue;
            for (int64_t g = 0; g < group; g++)
                attend(q, k_cache, v_cache, out, block_tables + seq * max_blocks, seq_lens[seq],
                       (seq * num_heads + kv * group + g) * head_dim, kv, num_kv_heads, head_dim,
                       block_size, window, scale, dtype, scores);
        }
        free(scores);
    }
    return failed;
}

/*
 * Stores new tokens' keys and values at their cache slots (slot = block * block_size + offset),
 * keys into the transposed block layout. k, v: (num_tokens, num_kv_heads, head_dim).
 */
void write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
              int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
              int dtype, int num_threads) {
    const int64_t row = num_kv_heads * head_dim;
    const int64_t elem_size = dtype == DTYPE_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        memcpy((char *)v_cache + slots[t] * row * elem_size, (const char *)v + t * row * elem_size,
               row * elem_size);
        for (int64_t i = 0; i < row; i++) {  /* i = kv * head_dim + d */
            const int64_t dst = (block * row + i) * block_size + offset;
            if (dtype == DTYPE_F32)
                ((float *)k_cache)[dst] = ((const float *)k)[t * row + i];
            else
                ((uint16_t *)k_cache)[dst] = ((const uint16_t *)k)[t * row + i];
        }
    }
}

/*
 * RMSNorm over the last dimension, numerically as Hugging Face's Llama computes it: in fp32,
 * x * rsqrt(mean(x^2) + eps) rounded to the activation dtype, then times the weight in the
 * activation dtype (for bf16 that is a second rounding, which we reproduce).
 * x, out: (num_rows, dim); weight: (dim,). out may alias x.
 */
void rms_norm(const void *x, const void *weight, void *out, int64_t num_rows, int64_t dim,
              float eps, int dtype, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float sum_sq = 0.0f;
        if (dtype == DTYPE_F32) {
            const float *row = (const float *)x + r * dim;
            const float *w = (const float *)weight;
            float *dst = (float *)out + r * dim;
            for (int64_t d = 0; d < dim; d++) sum_sq += row[d] * row[d];
            const float inv = 1.0f / sqrtf(sum_sq / (float)dim + eps);
            for (int64_t d = 0; d < dim; d++) dst[d] = w[d] * (row[d] * inv);
        } else {
            const uint16_t *row = (const uint16_t *)x + r * dim;
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *dst = (uint16_t *)out + r * dim;
            for (int64_t d = 0; d < dim; d++) sum_sq += bf16_to_f32(row[d]) * bf16_to_f32(row[d]);
            const float inv = 1.0f / sqrtf(sum_sq / (float)dim + eps);
            for (int64_t d = 0; d < dim; d++) {
                const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[d]) * inv));
                dst[d] = f32_to_bf16(bf16_to_f32(w[d]) * normed);
            }
        }
    }
}

/*
 * Rotary embedding in place, Hugging Face's "rotate_half" pairing (dimension i with i + D/2):
 * x' = x * cos + rotate_half(x) * sin, with the cos/sin tables the model computed (already in
 * the activation dtype). In bf16 each product and the sum round to bf16, as the separate
 * PyTorch ops of the reference do. x: (num_tokens, num_heads, head_dim); cos, sin:
 * (num_tokens, head_dim), whose two halves are equal.
 */
void rotary_embedding(void *x, const void *cos_table, const void *sin_table, int64_t num_tokens,
                      int64_t num_heads, int64_t head_dim, int dtype, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t base = (t * num_heads + h) * head_dim;
            if (dtype == DTYPE_F32) {
                float *v = (float *)x + base;
                const float *c = (const float *)cos_table + t * head_dim;
                const float *s = (const float *)sin_table + t * head_dim;
                for (int64_t i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * c[i] - b * s[i];
                    v[i + half] = b * c[i + half] + a * s[i + half];
                }
            } else {
                uint16_t *v = (uint16_t *)x + base;
                const uint16_t *c = (const uint16_t *)cos_table + t * head_dim;
                const uint16_t *s = (const uint16_t *)sin_table + t * head_dim;
                for (int64_t i = 0; i < half; i++) {
                    const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                    const float c0 = bf16_to_f32(c[i]), s0 = bf16_to_f32(s[i]);
                    const float c1 = bf16_to_f32(c[i + half]), s1 = bf16_to_f32(s[i + half]);
                    const float low = bf16_to_f32(f32_to_bf16(a * c0)) + bf16_to_f32(f32_to_bf16(-b * s0));
                    const float high = bf16_to_f32(f32_to_bf16(b * c1)) + bf16_to_f32(f32_to_bf16(a * s1));
                    v[i] = f32_to_bf16(low);
                    v[i + half] = f32_to_bf16(high);
                }
            }
        }
    }
}
