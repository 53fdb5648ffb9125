/*
 * What the kernel files share: the dtype codes, bf16 conversions, a 16-element fp32 loader, and
 * the attention entry points that the decode graph (cpu_ops.c) calls inside its parallel region
 * (attention.c). The files are separate translation units so that a first build compiles them
 * in parallel (cpu_kernels.py).
 */
#ifndef SLIPSTREAM_CPU_OPS_COMMON_H
#define SLIPSTREAM_CPU_OPS_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

/* Below this many rows, waking a second thread costs more than the work it would take over. */
enum { MIN_PARALLEL_ROWS = 16 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } bits = {.u = (uint32_t)x << 16};
    return bits.f;
}

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even, as torch does */
    union { float f; uint32_t u; } bits = {.f = x};
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
/* 16 consecutive elements as fp32. */
static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + index);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

/* attention.c: the decode attention of a batch, shared among the threads of the enclosing
 * parallel region (see attention_tasks), and the per-thread scratch it needs. */
int64_t max_seq_len(const int64_t *seq_lens, int64_t num_seqs);
int64_t attention_scratch_floats(int64_t max_len, int64_t num_heads, int64_t head_dim);
float *thread_scratch(int64_t floats, int *failed);

/* A decode batch's long sequences split into chunks, and where the chunks' partial results go
 * until they are merged (attention.c). */
typedef struct {
    int64_t *chunk_start;  /* num_seqs + 1: the chunks of the sequences before each */
    float *partials;       /* chunks x num_heads x (head_dim + 2); NULL when nothing is split */
} decode_split;
/* Returns 0, or 1 when its memory could not be allocated (then nothing is left to free). */
int plan_decode_split(const int64_t *seq_lens, int64_t num_seqs, int64_t window, int64_t num_heads,
                      int64_t head_dim, decode_split *split);
void free_decode_split(decode_split *split);
void attention_tasks(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                     int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t window, float scale, int dtype, int num_threads,
                     float *scratch, const int64_t *chunk_start, float *partials);

#endif
