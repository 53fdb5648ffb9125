/*
 * What the kernel files share: the dtype codes, bf16 conversions, a 16-element fp32 loader, and
 * the attention entry points that the decode graph (cpu_ops.c) calls inside its parallel region
 * (attention.c). The files are separate translation units so that a first build compiles them
 * in parallel (cpu_kernels.py).
 */
#ifndef SLIPSTREAM_CPU_OPS_COMMON_H
#define SLIPSTREAM_CPU_OPS_COMMON_H

#define _GNU_SOURCE  /* syscall, for the AMX permission; before any system header */

#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdatomic.h>
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

/* An fp8 KV cache (kv_cache_dtype) is named in bits 4-7 of the dtype argument of the functions
 * that read or write a cache (0 there: a cache of the activations' dtype, bits 0-3). */
enum { KV_DTYPE_E4M3 = 2, KV_DTYPE_E5M2 = 3 };

static inline int q_dtype_of(int dtype) { return dtype & 0xF; }
static inline int kv_dtype_of(int dtype) { return dtype >> 4 ? dtype >> 4 : dtype & 0xF; }
static inline int64_t kv_elem_size(int dtype) {
    const int kv = kv_dtype_of(dtype);
    return kv == DTYPE_F32 ? 4 : kv == DTYPE_BF16 ? 2 : 1;
}

/* Whether a dtype argument is one the cache functions take: fp32 or bf16 activations (bits 0-3)
 * over a cache of theirs (bits 4-7 zero) or an fp8 one, nothing above. */
static inline int valid_cache_dtype(int dtype) {
    const int q = dtype & 0xF, kv = dtype >> 4;
    return (q == DTYPE_F32 || q == DTYPE_BF16) && (kv == 0 || kv == KV_DTYPE_E4M3 || kv == KV_DTYPE_E5M2);
}

/* The fp32 value of `bits` as an fp8 byte (kv: KV_DTYPE_*), as write_kv's PyTorch path stores it
 * (paged_attention.py's to_cache_dtype): saturated at the format's largest finite value (inf
 * too), then rounded to nearest even as torch's cast rounds; a NaN stays a NaN (0x7F and its
 * sign, torch's code). Integer arithmetic only: -ffast-math may assume floats are never NaN.
 * The tests compare it with torch on every bf16 value and on random fp32 ones. */
static inline uint8_t f32_bits_to_fp8(uint32_t bits, int kv) {
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const uint32_t magnitude = bits & 0x7FFFFFFFu, exponent = magnitude >> 23;
    const int e5m2 = kv == KV_DTYPE_E5M2, mantissa_bits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    if (magnitude > 0x7F800000u) return sign | 0x7F;
    if (magnitude >= (e5m2 ? 0x47600000u /* 57344 */ : 0x43E00000u /* 448 */))
        return sign | (e5m2 ? 0x7B : 0x7E);
    /* Below the smallest normal the byte counts subnormal steps, 2^(1 - bias - mantissa_bits): the
     * 24-bit significand shifted down by the exponents between, rounded to nearest even (a count
     * of 2^mantissa_bits is the smallest normal's code). Else the fp32 mantissa rounded to
     * mantissa_bits, a carry lifting the exponent, and the exponent rebiased. */
    uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    int shift = 151 - bias - mantissa_bits - (int)exponent;
    if (exponent >= (uint32_t)(128 - bias)) significand = magnitude, shift = 23 - mantissa_bits;
    if (exponent == 0 || shift > 25) return sign;
    const uint32_t rounded = (significand + (1u << (shift - 1)) - 1u + ((significand >> shift) & 1u)) >> shift;
    if (exponent < (uint32_t)(128 - bias)) return sign | (uint8_t)rounded;
    return sign | (uint8_t)(rounded - ((uint32_t)(127 - bias) << mantissa_bits));
}

#if defined(__AVX512F__)
/* For the element-wise loops GCC vectorises (norms, rotary, silu, softmax): 16 lanes, as the
 * hand-written kernels use, rather than the 8 GCC prefers for Intel CPUs (its expf then runs 16
 * at a time too). */
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))

/* 16 bf16 as fp32: exact, each widened to 32 bits and shifted into the high half. */
static inline __m512 widen_bf16_16(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 consecutive elements as fp32. */
static inline __m512 load16(const void *base, int64_t index, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + index);
    return widen_bf16_16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
}

/* The even and odd bf16 of each 32-bit lane of 32 bf16 values (a pair of consecutive elements
 * per lane), as fp32: exact, by a shift and by a mask. */
static inline __m512 even_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 odd_bf16(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* acc += the products of 32 bf16 pairs a and b, summed per lane in fp32: with AVX512-BF16 one
 * vdpbf16ps into acc[0]; without it (Skylake to Ice Lake Xeons) both operands widened to fp32 and
 * the even and odd products into acc[0] and acc[1], two chains of FMAs where one would wait on
 * the other. The caller adds acc[0] and acc[1] at the end. */
static inline void accumulate_bf16_pairs(__m512 acc[2], __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)a, (__m512bh)b);
#else
    acc[0] = _mm512_fmadd_ps(even_bf16(a), even_bf16(b), acc[0]);
    acc[1] = _mm512_fmadd_ps(odd_bf16(a), odd_bf16(b), acc[1]);
#endif
}

/* 16 fp32 values rounded to bf16, to nearest even as torch rounds (f32_to_bf16). */
static inline __m256i round_to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* exp(x) of 16 lanes, x <= 88.7 (the callers' range): x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in
 * two parts, as Cody and Waite split it), e^r by its Taylor polynomial to r^7 (relative error
 * below 2^-24 on that interval), times 2^n by vscalefps, which gives 0 for the n of x < -104. A
 * few instructions where the vector expf GCC calls is a function call per 16 values. */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WIDE_VECTORS
/* AVX2 with FMA and without AVX-512 (Haswell to Alder Lake, Zen 1 to 3): the products of the
 * matrix-vector and panel kernels in 8-lane vectors, bf16 widened to fp32 as above, fp8 through
 * fp16 (F16C, which every CPU with AVX2 and FMA has). */
#define SLIPSTREAM_AVX2 1

static inline __m256 even_bf16_8(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
static inline __m256 odd_bf16_8(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 consecutive bf16 as fp32: exact, each widened to 32 bits and shifted into the high half. */
static inline __m256 widen_bf16_8(const uint16_t *src) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

static inline float sum_lanes_8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 fp32 values rounded to bf16, to nearest even as f32_to_bf16 rounds. After the shift every
 * lane is below 2^16, so the signed-to-unsigned pack never saturates. */
static inline __m128i round_to_bf16_8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
#endif
#if !defined(WIDE_VECTORS)
#define WIDE_VECTORS
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/*
 * AMX (Intel Xeons from Sapphire Rapids on): eight tile registers of up to 16 rows x 64 bytes and
 * tdpbf16ps, C (16 x 16 fp32) += A (16 rows x 32 bf16) . B (16 rows of 16 columns x 2 bf16, pairs
 * of consecutive k side by side): 8,192 multiply-adds per instruction. The bf16 panel products
 * (cpu_ops.c) and prefill attention (attention.c) use them. Linux hands the tiles only to a
 * process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, once per process, for all its threads);
 * where it refuses, the vector kernels run instead.
 */
#define SLIPSTREAM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

static inline int amx_granted(void) {
    static _Atomic int state = 0;  /* 0: not asked yet, 1: granted, -1: refused */
    int seen = atomic_load(&state);
    if (seen == 0) {
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&state, seen);
    }
    return seen == 1;
}

typedef struct {  /* ldtilecfg's operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* This thread's tiles, all 64 bytes wide: `sums` tiles of `rows` rows from tile 0 (fp32 sums), then
 * `a` tiles of `rows` rows (bf16 rows of A), then `b` tiles of 16 rows (bf16 pairs of B). */
static inline void configure_amx(int64_t rows, int sums, int a, int b) {
    tile_config config = {.palette = 1};
    for (int t = 0; t < sums + a + b; t++) {
        config.colsb[t] = 64;
        config.rows[t] = t < sums + a ? (uint8_t)rows : 16;
    }
    _tile_loadconfig(&config);
}
#endif

/*
 * Work stealing among the threads of a parallel region, for the panel products (cpu_ops.c) and
 * decode attention (attention.c). Each thread starts on its share [begin, end) of a loop's tasks,
 * in memory order, so that it can request its next task's data while computing the current one;
 * a thread whose share is done takes tasks from the back of the others' (without requests: its
 * next task is not the next in memory). Even shares of even work did not finish together: the
 * VM's two cores ran at different speeds from moment to moment, and over the bench model's 48
 * fp32 weights at 64 rows the faster thread's wait at the end of each product took ~9% of the
 * products' samples (perf, in libgomp).
 *
 * A share's state is one word, so that a compare-and-swap moves either end: the loop's number
 * (16 bits, counted by each thread: every thread of a team runs the same loops in the same
 * order), the share's back and its front (24 bits each: a loop has fewer than 2^24 tasks). A
 * thread steals only from a share of the same loop: one not yet opened, or already a later
 * loop's, is skipped. A loop opened this way has no barrier at its end.
 */
typedef struct {
    _Alignas(64) _Atomic uint64_t word;
} task_share;

typedef struct {
    task_share *shares;  /* one per thread of the team, shared by the team */
    uint32_t loop;       /* this thread's count of the loops it has opened */
    int victim;          /* the share this thread takes from in the current loop */
} task_team;

enum { SHARE_BITS = 24 };
#define SHARE_MASK ((UINT64_C(1) << SHARE_BITS) - 1)

/* Before the parallel region: every share empty. */
static inline void clear_shares(task_share *shares, int num_threads) {
    for (int t = 0; t < num_threads; t++) atomic_init(&shares[t].word, 0);
}

/* This thread's view of a team over `shares` (cleared by clear_shares). */
static inline task_team team_of(task_share *shares) {
    return (task_team){.shares = shares, .loop = 0, .victim = omp_get_thread_num()};
}

static inline uint64_t share_word(uint32_t loop, int64_t front, int64_t back) {
    return (uint64_t)(loop & 0xFFFF) << (2 * SHARE_BITS) | (uint64_t)back << SHARE_BITS | (uint64_t)front;
}

/* Publishes this thread's share [begin, end) of the team's next loop. */
static inline void open_share(task_team *team, int64_t begin, int64_t end) {
    team->loop = (team->loop + 1) & 0xFFFF;
    team->victim = omp_get_thread_num();
    atomic_store(&team->shares[omp_get_thread_num()].word, share_word(team->loop, begin, end));
}

/* Takes the front (from_back 0) or the back task of `thread`'s share of this loop into *task; 0
 * when it is empty or not this loop's. */
static inline int take_task(task_team *team, int thread, int from_back, int64_t *task) {
    _Atomic uint64_t *word = &team->shares[thread].word;
    uint64_t seen = atomic_load(word);
    for (;;) {
        const int64_t front = (int64_t)(seen & SHARE_MASK), back = (int64_t)(seen >> SHARE_BITS & SHARE_MASK);
        if (seen >> (2 * SHARE_BITS) != team->loop || front >= back) return 0;
        const uint64_t next = from_back ? share_word(team->loop, front, back - 1)
                                        : share_word(team->loop, front + 1, back);
        if (atomic_compare_exchange_weak(word, &seen, next)) {
            *task = from_back ? back - 1 : front;
            return 1;
        }
    }
}

/* This thread's next task of the loop: its own share's front, else another's back (*stolen set);
 * 0 when none is left. */
static inline int next_task(task_team *team, int *stolen, int64_t *task) {
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    for (;;) {
        if (take_task(team, team->victim, team->victim != me, task)) {
            *stolen = team->victim != me;
            return 1;
        }
        team->victim = (team->victim + 1) % threads;
        if (team->victim == me) return 0;
    }
}

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
    int64_t chunk_keys;    /* keys per chunk (a sequence's last chunk may have fewer) */
} decode_split;
/* Returns 0, or 1 when its memory could not be allocated (then nothing is left to free). */
int plan_decode_split(const int64_t *seq_lens, int64_t num_seqs, int64_t window, int64_t num_heads,
                      int64_t head_dim, int num_threads, decode_split *split);
void free_decode_split(decode_split *split);
void attention_tasks(task_team *team, const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs,
                     int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t window, float scale, float softcap, int dtype,
                     int num_threads, float *scratch, const decode_split *split);

#endif
