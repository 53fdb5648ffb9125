/*
 * Matrix products, row operations and the decode graph, on the CPU: the matrix-vector kernel of
 * batch-1 decode, the panel GEMM of decode batches, KV-cache writes, RMSNorm, the rotary
 * embedding, silu-and-mul, and decode_layers, which runs a whole decode step of the layer stack
 * in one call (its attention is attention.c's). fp32 and bf16; bf16 multiplies on AMX tiles, in
 * vdpbf16ps or widened to fp32, by what the CPU has.
 */
#include "common.h"


/*
 * Matrix-vector products for a few rows: y (M, N) = x (M, K) W^T (+ bias), W row-major (N, K) as
 * nn.Linear stores it. Batch-1 decode reads every weight once per token, so this is the
 * memory-bound inner loop of single-stream latency: four weight rows are streamed at a time,
 * each against every row of x, with fp32 accumulation (bf16 pairs through vdpbf16ps where the CPU
 * has AVX512-BF16; in bf16 several rows of x share every load of the weight, gemv_bf16_rows_of).
 * Each thread reads one contiguous run of rows, which the hardware prefetcher follows; software
 * prefetching of the next rows measured no faster, and slower for K = 2048.
 * M <= MAX_GEMV_ROWS; where the panel copies are kept, M < min_panel_rows(dtype).
 */
enum { MAX_GEMV_ROWS = 4, MIN_PANEL_ROWS = 3 };
_Static_assert(MAX_GEMV_ROWS == 4, "gemv_rows dispatches bf16 on 2 to 4 rows");

/* The dtype the products of the kernels (panel, matrix-vector, prefill attention) multiply in
 * for inputs of `dtype`: bf16 pairs on a CPU with AVX512-BF16 (vdpbf16ps, fp32 sums), else fp32
 * (bf16 widened exactly). */
int arithmetic_dtype(int dtype) {
#if defined(__AVX512BF16__)
    return dtype;
#else
    (void)dtype;
    return DTYPE_F32;
#endif
}

static int amx_takes(int64_t K);

/* The fewest rows that take the panel kernel where its copies are kept; fewer take the
 * matrix-vector kernel. MIN_PANEL_ROWS in general: from 3 rows the panel kernel is faster
 * (decode steps of the ~125M bench model through the engine on the Zen 4, the two alternating: 3
 * sequences 1.1x bf16 and 1.2x fp32, 4 sequences 1.05x and 1.2-1.4x), at 2 rows it is not (0.9x
 * bf16, 0.96x fp32). bf16 without AVX512-BF16 takes the panel kernel from one row: it widens each
 * weight vector once where the matrix-vector kernel widens x as well, and it prefetches the next
 * panel (all 48 weights of the bench model, Ice Lake Xeon, the two alternating: 1.15x at 1 row,
 * 1.26x at 2), and so does bf16 with AVX2 (Zen 3, benchmarks/linear_kernels.py: 13.5-17.6 against
 * 12.0-16.4 GFLOP/s at 1 row; fp32 about even, 7.7-7.9 against 7.2-8.1), and so does bf16 on AMX
 * tiles (Intel Xeon, model 167: 21.8 against 18.9 GFLOP/s at 1 row, 42.4 against 31.3 at 2). */
int min_panel_rows(int dtype) {
#if (defined(__AVX512F__) || defined(SLIPSTREAM_AVX2)) && !defined(__AVX512BF16__)
    if (dtype == DTYPE_BF16) return 1;
#endif
    if (dtype == DTYPE_BF16 && amx_takes(32)) return 1;
    return MIN_PANEL_ROWS;
}

/* Two accumulators: with one, each row's multiply-adds wait on each other, and at the full
 * bandwidth of the development VM's fast minutes the fp32 stream ran at ~52 GB/s instead of ~61
 * (all 49 weights of the ~125M bench model, 2 threads, alternating in one process). bf16 measured
 * no faster with two (or four), fp32 slower with four. */
static inline float dot_f32(const float *w, const float *x, int64_t K) {
    int64_t k = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc);
        acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), acc2);
    }
    for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc);
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
#elif defined(SLIPSTREAM_AVX2)
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), acc2);
    }
    for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc);
    sum = sum_lanes_8(_mm256_add_ps(acc, acc2));
#endif
    for (; k < K; k++) sum += w[k] * x[k];
    return sum;
}

static inline float dot_bf16_rows(const uint16_t *w, const uint16_t *x, int64_t K) {
    int64_t k = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; k + 32 <= K; k += 32)
        accumulate_bf16_pairs(acc, _mm512_loadu_si512(w + k), _mm512_loadu_si512(x + k));
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
#elif defined(SLIPSTREAM_AVX2)
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m256i wk = _mm256_loadu_si256((const __m256i *)(w + k));
        const __m256i xk = _mm256_loadu_si256((const __m256i *)(x + k));
        even = _mm256_fmadd_ps(even_bf16_8(wk), even_bf16_8(xk), even);
        odd = _mm256_fmadd_ps(odd_bf16_8(wk), odd_bf16_8(xk), odd);
    }
    sum = sum_lanes_8(_mm256_add_ps(even, odd));
#endif
    for (; k < K; k++) sum += bf16_to_f32(w[k]) * bf16_to_f32(x[k]);
    return sum;
}

/* gemv_rows for 2 <= M <= MAX_GEMV_ROWS bf16 rows of x (M fixed, so the loops over them unroll): one
 * accumulator per row of x, all sharing every load of the weight. With two rows, each row of x in
 * turn against the weight (read again from L1) streamed all 49 weights of the ~125M bench model
 * at ~37 GB/s where this order reaches ~59 (2 threads, a standalone C loop alternating the
 * variants, fast minutes of the development VM, ~60 GB/s probe); through linear_kernels.py
 * 1.2-1.25x. The same shared loads measured 1.15x in fp32 in that loop but 0.8x through
 * linear_kernels.py, and a single row gained nothing from them, so both keep the loop below. */
static inline __attribute__((always_inline)) void gemv_bf16_rows_of(
    const uint16_t *W, const uint16_t *x, const uint16_t *bias, const uint16_t *residual, uint16_t *y,
    const int M, int64_t N, int64_t K) {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *w = W + n * K;
        float sums[MAX_GEMV_ROWS];
        int64_t k = 0;
        for (int m = 0; m < M; m++) sums[m] = 0.0f;
#if defined(__AVX512F__)
        __m512 acc[MAX_GEMV_ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
            const __m512i wk = _mm512_loadu_si512(w + k);
            for (int m = 0; m < M; m++) accumulate_bf16_pairs(acc[m], wk, _mm512_loadu_si512(x + m * K + k));
        }
        for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#elif defined(SLIPSTREAM_AVX2)
        __m256 acc[MAX_GEMV_ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m256i wk = _mm256_loadu_si256((const __m256i *)(w + k));
            const __m256 even = even_bf16_8(wk), odd = odd_bf16_8(wk);
            for (int m = 0; m < M; m++) {
                const __m256i xk = _mm256_loadu_si256((const __m256i *)(x + m * K + k));
                acc[m][0] = _mm256_fmadd_ps(even, even_bf16_8(xk), acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(odd, odd_bf16_8(xk), acc[m][1]);
            }
        }
        for (int m = 0; m < M; m++) sums[m] = sum_lanes_8(_mm256_add_ps(acc[m][0], acc[m][1]));
#endif
        for (; k < K; k++)
            for (int m = 0; m < M; m++) sums[m] += bf16_to_f32(w[k]) * bf16_to_f32(x[m * K + k]);
        for (int m = 0; m < M; m++) {
            float value = sums[m];
            if (bias != NULL) value += bf16_to_f32(bias[n]);
            uint16_t rounded = f32_to_bf16(value);
            if (residual != NULL)
                rounded = f32_to_bf16(bf16_to_f32(residual[m * N + n]) + bf16_to_f32(rounded));
            y[m * N + n] = rounded;
        }
    }
}

/* Output features per task of gemv_rows: 256 KiB of an fp32 weight of 768 columns. */
enum { GEMV_TASK_ROWS = 64 };

/* The rows of y among the threads of the enclosing parallel region, which all return with y
 * complete: each thread streams its share of consecutive weight rows, then steals tasks of
 * GEMV_TASK_ROWS rows from the back of the others' (common.h): 1.01-1.04x the static split at
 * one and two rows over the bench model's 48 fp32 weights (Zen 3, 31 alternating rounds; the
 * stream is bound by the memory the cores share, not by either core). With `residual`, y = residual +
 * (x W^T + b), the product rounded to the dtype before the sum as `h + linear(x)` rounds in
 * PyTorch; y may alias residual. */
static void gemv_rows(task_team *team, const void *W, const void *x, const void *bias, const void *residual,
                      void *y, int64_t M, int64_t N, int64_t K, int dtype) {
    if (dtype != DTYPE_F32 && M > 1) {
        const uint16_t *w = W, *xs = x, *b = bias, *r = residual;
        switch (M) {
        case 2: gemv_bf16_rows_of(w, xs, b, r, y, 2, N, K); return;
        case 3: gemv_bf16_rows_of(w, xs, b, r, y, 3, N, K); return;
        case 4: gemv_bf16_rows_of(w, xs, b, r, y, 4, N, K); return;
        default: return;  /* callers never pass more than MAX_GEMV_ROWS */
        }
    }
    const int me = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t tasks = (N + GEMV_TASK_ROWS - 1) / GEMV_TASK_ROWS;
    open_share(team, tasks * me / threads, tasks * (me + 1) / threads);
    int stolen = 0;
    int64_t task;
    while (next_task(team, &stolen, &task)) {
        const int64_t end = (task + 1) * GEMV_TASK_ROWS < N ? (task + 1) * GEMV_TASK_ROWS : N;
        for (int64_t n0 = task * GEMV_TASK_ROWS; n0 < end; n0 += 4) {
            const int64_t rows = end - n0 < 4 ? end - n0 : 4;
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t n = n0 + r;
                    if (dtype == DTYPE_F32) {
                        float value = dot_f32((const float *)W + n * K, (const float *)x + m * K, K);
                        if (bias != NULL) value += ((const float *)bias)[n];
                        if (residual != NULL) value += ((const float *)residual)[m * N + n];
                        ((float *)y)[m * N + n] = value;
                    } else {
                        float value =
                            dot_bf16_rows((const uint16_t *)W + n * K, (const uint16_t *)x + m * K, K);
                        if (bias != NULL) value += bf16_to_f32(((const uint16_t *)bias)[n]);
                        uint16_t rounded = f32_to_bf16(value);
                        if (residual != NULL)
                            rounded = f32_to_bf16(bf16_to_f32(((const uint16_t *)residual)[m * N + n]) +
                                                  bf16_to_f32(rounded));
                        ((uint16_t *)y)[m * N + n] = rounded;
                    }
                }
        }
    }
#pragma omp barrier
}

void gemv(const void *W, const void *x, const void *bias, void *y, int64_t M, int64_t N,
          int64_t K, int dtype, int num_threads) {
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        task_team team = team_of(shares);
        gemv_rows(&team, W, x, bias, NULL, y, M, N, K, dtype);
    }
}

/*
 * Matrix products y (M, N) = x (M, K) W^T (+ bias) for any M, over a copy of W packed in panels of
 * PANEL_COLS = 48 output features (16 with AVX2, below), k-major within a panel (pack_panels): in fp32
 * panels[p][k][j] = W[p*48 + j][k]; in bf16 pairs of consecutive k side by side,
 * panels[p][k/2][j][k%2], as vdpbf16ps takes them (with AVX2 k-major as in fp32, the AVX2 bf16
 * kernel below); zero past N (and past an odd K). A micro-kernel
 * keeps an 8 x 48 block of y in 24 fp32 registers and, per k (per pair of k in bf16), loads three
 * vectors of the panel and broadcasts one x value (pair) per row: 24 FMAs (vdpbf16ps) per 11 loads.
 * In fp32 the panel is walked in chunks of PANEL_K_CHUNK values of k (96 KiB, so that a chunk
 * stays in L2 while every block of 8 rows passes over it), partial sums going through y; a bf16
 * panel (96 bytes per k) is walked whole for each block of rows, its sums kept in registers and
 * rounded to bf16 once. The next chunk (panel) in memory order, the thread's next piece of work,
 * is requested a line or a few every other k, so that streaming the weights from memory overlaps
 * the arithmetic. This is where it beats oneDNN on decode batches (M of tens of rows), whose
 * weights come from memory every step: on the AMD EPYC development machine, with 48 distinct
 * weights of the bench model's shapes (cold), 1.1-1.3x oneDNN from 8 to 128 rows in fp32 and
 * 1.1-1.4x in bf16; from 256 rows on about even in fp32 (ahead at 2048, with rows in bands) and
 * 0.94-0.99x in bf16 (benchmarks/linear_kernels.py).
 */
#if defined(__AVX512F__)
enum { PANEL_COLS = 48, PANEL_ROWS = 8, PANEL_K_CHUNK = 512 };
#define HAS_PANEL_KERNEL 1
#elif defined(SLIPSTREAM_AVX2)
/* AVX2 has 16 vector registers of 8 floats: a 6 x 16 block of y in 12 of them (two vectors per
 * row), two for the panel's vectors and one broadcast, the shape of BLIS's Haswell kernel; per k
 * 12 FMAs for 8 loads. A panel row is one 64-byte line, in fp32 and in bf16 pairs alike. An fp32
 * chunk of 1,024 k is 64 KiB (Zen 3: 0.90x oneDNN at 64 rows, 0.83x with chunks of 256). */
enum { PANEL_COLS = 16, PANEL_ROWS = 6, PANEL_K_CHUNK = 1024 };
#define HAS_PANEL_KERNEL 1
#else
enum { PANEL_COLS = 48 };
#endif
/* Cache lines of one panel row: one k in fp32, one pair of k in bf16. */
enum { PANEL_ROW_LINES = PANEL_COLS * 4 / 64 };

int has_panel_gemm(int dtype) {
#if defined(HAS_PANEL_KERNEL)
    return dtype == DTYPE_F32 || dtype == DTYPE_BF16;
#else
    (void)dtype;
    return 0;
#endif
}

/* Whether the panel kernel should take inputs of every size, prefill chunks included, where oneDNN
 * could take the large ones: with AVX-512 where it multiplies in fp32 (fp32 on par with oneDNN
 * from 256 to 1,024 rows and ahead at 2,048 on the Zen 4 and 5; bf16 without AVX512-BF16 3.6x
 * oneDNN's bf16 on an Ice Lake Xeon), not with AVX2, where oneDNN's fp32 product is ahead from 64
 * rows on (Zen 3, benchmarks/linear_kernels.py: 0.74-0.76x at 512 and 2,048 rows). */
int panel_gemm_takes_all_rows(int dtype) {
#if defined(__AVX512F__)
    return arithmetic_dtype(dtype) == DTYPE_F32;
#else
    (void)dtype;
    return 0;
#endif
}

/* Elements (of the weight's dtype) of the packed copy of an (N, K) weight. */
int64_t panel_numel(int64_t N, int64_t K, int dtype) {
    const int64_t cols = (N + PANEL_COLS - 1) / PANEL_COLS * PANEL_COLS;
    return dtype == DTYPE_F32 ? cols * K : cols * 2 * ((K + 1) / 2);
}

void pack_panels(const void *W, void *panels, int64_t N, int64_t K, int dtype, int num_threads) {
    const int64_t depth = dtype == DTYPE_F32 ? K : (K + 1) / 2;  /* k values (pairs) per panel */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < (N + PANEL_COLS - 1) / PANEL_COLS; p++)
        for (int64_t d = 0; d < depth; d++)
            for (int64_t j = 0; j < PANEL_COLS; j++) {
                const int64_t n = p * PANEL_COLS + j, slot = (p * depth + d) * PANEL_COLS + j;
                if (dtype == DTYPE_F32) {
                    ((float *)panels)[slot] = n < N ? ((const float *)W)[n * K + d] : 0.0f;
                    continue;
                }
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t k = 2 * d + e;
#if defined(SLIPSTREAM_AVX2)
                    const int64_t at = ((p * depth + d) * 2 + e) * PANEL_COLS + j;  /* k-major, as fp32 */
#else
                    const int64_t at = 2 * slot + e;  /* pairs side by side, as vdpbf16ps takes them */
#endif
                    ((uint16_t *)panels)[at] = n < N && k < K ? ((const uint16_t *)W)[n * K + k] : 0;
                }
            }
}

#if defined(HAS_PANEL_KERNEL)
/* This thread's pieces of an (M, N) product: whole panels, and the rows split too when there are
 * too few panels to keep every thread busy. Task t is panel t / row_groups and row group
 * t % row_groups; thread i runs tasks [begin, end) = [tasks * i / threads, tasks * (i + 1) / threads). */
typedef struct {
    int64_t blocks, row_groups, begin, end;
} panel_schedule;

typedef struct {
    int64_t panel, block_begin, block_end, cols;  /* blocks of PANEL_ROWS rows; valid columns */
} panel_task;

static panel_schedule thread_panel_schedule(int64_t M, int64_t N, int64_t block_rows) {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t num_panels = (N + PANEL_COLS - 1) / PANEL_COLS;
    const int64_t blocks = (M + block_rows - 1) / block_rows;
    int64_t row_groups = (4 * threads + num_panels - 1) / num_panels;
    row_groups = row_groups > blocks ? blocks : row_groups;
    const int64_t tasks = num_panels * row_groups;
    return (panel_schedule){.blocks = blocks, .row_groups = row_groups,
                            .begin = tasks * thread / threads, .end = tasks * (thread + 1) / threads};
}

/* The first row of block b of `blocks`: M rows in blocks of as even sizes as PANEL_ROWS allows
 * (64 rows with AVX2 in nine blocks of 6 and two of 5 rather than ten of 6 and one of 4), since a
 * block of few rows leaves the FMA units waiting on its accumulators' latency: in a decode step
 * of 64 rows on the Zen 3 the 4-row block took 1.8x the time per row of the 6-row ones (perf).
 * The bench model's 48 weights, alternating with the previous split over 31 rounds: fp32 1.02-1.03x
 * at 64 rows, 1.07x at 16, 1.04x at 40, 1.02x at 100; bf16 0.99-1.01x. */
static inline int64_t block_row(int64_t b, int64_t M, int64_t blocks) {
    return b * M / blocks;
}

static panel_task panel_task_at(const panel_schedule *schedule, int64_t task, int64_t N) {
    const int64_t p = task / schedule->row_groups, group = task % schedule->row_groups;
    return (panel_task){
        .panel = p,
        .block_begin = schedule->blocks * group / schedule->row_groups,
        .block_end = schedule->blocks * (group + 1) / schedule->row_groups,
        .cols = N - p * PANEL_COLS < PANEL_COLS ? N - p * PANEL_COLS : PANEL_COLS,
    };
}

/* y[0:ROWS, 0:cols] (+)= x[0:ROWS, 0:kc] . chunk (kc x PANEL_COLS), where x rows are ldx apart and y
 * rows N apart. first: start from zero (and bias, when last as well), else from y; last: add the
 * bias. pf_lines lines of `prefetch` are requested every other k. */
#if defined(__AVX512F__)
#define PANEL_KERNEL(ROWS)                                                                     \
    static void panel_kernel_##ROWS(const float *x, int64_t ldx, const float *chunk, int64_t kc, \
                                    float *y, int64_t N, int64_t cols, const float *bias,      \
                                    int first, int last, const char *prefetch, int64_t pf_lines) { \
        const __mmask16 masks[3] = {                                                           \
            cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1u),                              \
            cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1u),      \
            cols >= 48 ? 0xFFFF : cols <= 32 ? 0 : (__mmask16)((1u << (cols - 32)) - 1u)};     \
        __m512 acc[ROWS][3];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                         \
            for (int j = 0; j < 3; j++)                                                        \
                acc[r][j] = first ? _mm512_setzero_ps()                                        \
                                  : _mm512_maskz_loadu_ps(masks[j], y + r * N + 16 * j);       \
        for (int64_t k = 0; k < kc; k++) {                                                     \
            if ((k & 1) == 0)                                                                  \
                for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1); \
            const float *w = chunk + k * PANEL_COLS;                                           \
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16),                \
                         w2 = _mm512_loadu_ps(w + 32);                                         \
            for (int r = 0; r < ROWS; r++) {                                                   \
                const __m512 b = _mm512_set1_ps(x[r * ldx + k]);                               \
                acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);                                 \
                acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);                                 \
                acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);                                 \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < 3; j++) {                                                          \
            const __m512 add = last && bias != NULL ? _mm512_maskz_loadu_ps(masks[j], bias + 16 * j) \
                                                    : _mm512_setzero_ps();                     \
            for (int r = 0; r < ROWS; r++)                                                     \
                _mm512_mask_storeu_ps(y + r * N + 16 * j, masks[j], _mm512_add_ps(acc[r][j], add)); \
        }                                                                                      \
    }
PANEL_KERNEL(1) PANEL_KERNEL(2) PANEL_KERNEL(3) PANEL_KERNEL(4)
PANEL_KERNEL(5) PANEL_KERNEL(6) PANEL_KERNEL(7) PANEL_KERNEL(8)
#undef PANEL_KERNEL

typedef void (*panel_kernel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                                int64_t, const float *, int, int, const char *, int64_t);
static const panel_kernel_fn panel_kernels[PANEL_ROWS + 1] = {
    NULL, panel_kernel_1, panel_kernel_2, panel_kernel_3, panel_kernel_4,
    panel_kernel_5, panel_kernel_6, panel_kernel_7, panel_kernel_8};
#else
/* Lanes [0, n) of 8 set, as AVX2's masked loads and stores take them. */
/* Loops over the rows and columns of a block of y unrolled before GCC decides where the block's
 * accumulators live: left as loops, it kept them on the stack, storing all 12 after every k (the
 * fp32 kernel ran at ~40% of the peak). */
#define UNROLLED _Pragma("GCC unroll 8")

static inline __m256i first_lanes_8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* One k of the block: the panel row's two vectors against one broadcast x value per row. */
#define PANEL_STEP(ROWS, k)                                                                    \
    do {                                                                                       \
        const float *w = chunk + (k) * PANEL_COLS;                                             \
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                     \
        UNROLLED for (int r = 0; r < ROWS; r++) {                                              \
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + (k));                           \
            acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);                                     \
            acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);                                     \
        }                                                                                      \
    } while (0)

/* k goes PANEL_UNROLL at a time, the prefetch requests once per group: stepping one k at a time,
 * with the request check at every other k, the loop's bookkeeping took issue slots from the 12
 * FMAs of each k. A whole panel's block of y is loaded and stored plainly: the masked forms
 * (vmaskmovps) are slow on AMD. The two together, the bench model's 48 weights (cold) alternating
 * with the previous kernel in one process, medians of the per-round ratios over 31 rounds (Zen 3):
 * 16 rows 1.04-1.05x, 64 rows 1.06-1.12x (1.0 in a minute when both ran at ~80 GFLOP/s), 256
 * rows 1.12x; the products are the same bit for bit (the same FMAs in the same order). */
enum { PANEL_UNROLL = 4 };

#define PANEL_KERNEL(ROWS)                                                                     \
    static void panel_kernel_##ROWS(const float *x, int64_t ldx, const float *chunk, int64_t kc, \
                                    float *y, int64_t N, int64_t cols, const float *bias,      \
                                    int first, int last, const char *prefetch, int64_t pf_lines) { \
        /* The column masks are made again for the stores: live across the loop, they would take \
         * two of the 16 registers and push the accumulators onto the stack. */                 \
        const int whole = cols == PANEL_COLS;                                                  \
        __m256 acc[ROWS][2];                                                                   \
        UNROLLED for (int r = 0; r < ROWS; r++)                                                \
            UNROLLED for (int j = 0; j < 2; j++)                                               \
                acc[r][j] = first ? _mm256_setzero_ps()                                        \
                          : whole ? _mm256_loadu_ps(y + r * N + 8 * j)                         \
                                  : _mm256_maskload_ps(y + r * N + 8 * j, first_lanes_8(cols - 8 * j)); \
        int64_t k = 0;                                                                         \
        for (; k + PANEL_UNROLL <= kc; k += PANEL_UNROLL) {                                    \
            /* pf_lines lines per two k, as the caller counts them */                         \
            for (int64_t l = 0; l < pf_lines * PANEL_UNROLL / 2; l++, prefetch += 64)          \
                _mm_prefetch(prefetch, _MM_HINT_T1);                                           \
            UNROLLED for (int u = 0; u < PANEL_UNROLL; u++) PANEL_STEP(ROWS, k + u);           \
        }                                                                                      \
        for (; k < kc; k++) PANEL_STEP(ROWS, k);                                               \
        UNROLLED for (int j = 0; j < 2; j++) {                                                 \
            const __m256i mask = first_lanes_8(cols - 8 * j);                                  \
            const __m256 add = last && bias != NULL ? _mm256_maskload_ps(bias + 8 * j, mask)   \
                                                    : _mm256_setzero_ps();                     \
            UNROLLED for (int r = 0; r < ROWS; r++) {                                          \
                const __m256 sum = _mm256_add_ps(acc[r][j], add);                              \
                if (whole) _mm256_storeu_ps(y + r * N + 8 * j, sum);                           \
                else _mm256_maskstore_ps(y + r * N + 8 * j, mask, sum);                        \
            }                                                                                  \
        }                                                                                      \
    }
PANEL_KERNEL(1) PANEL_KERNEL(2) PANEL_KERNEL(3) PANEL_KERNEL(4) PANEL_KERNEL(5) PANEL_KERNEL(6)
#undef PANEL_KERNEL
#undef PANEL_STEP

typedef void (*panel_kernel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                                int64_t, const float *, int, int, const char *, int64_t);
static const panel_kernel_fn panel_kernels[PANEL_ROWS + 1] = {
    NULL, panel_kernel_1, panel_kernel_2, panel_kernel_3, panel_kernel_4, panel_kernel_5, panel_kernel_6};
#endif

/* This thread's part of the product, inside a parallel region (no barrier at the end): tasks
 * from its share, then stolen from others' (common.h). Stealing, with the bench model's weights
 * alternating with even static shares over 31 rounds (Zen 3, per-round ratios' medians): fp32
 * 1.09x at 64 and 256 rows, bf16 1.06x at 64, 1.07x at 256 and 1.13x at 2,048; even at 16 rows. */
static void panel_tasks_f32(task_team *team, const float *x, const float *panels, const float *bias, float *y,
                            int64_t M, int64_t N, int64_t K) {
    const panel_schedule schedule = thread_panel_schedule(M, N, PANEL_ROWS);
    open_share(team, schedule.begin, schedule.end);
    int stolen = 0;
    int64_t task;
    while (next_task(team, &stolen, &task)) {
        const panel_task t = panel_task_at(&schedule, task, N);
        for (int64_t k0 = 0; k0 < K; k0 += PANEL_K_CHUNK) {
            const int64_t kc = K - k0 < PANEL_K_CHUNK ? K - k0 : PANEL_K_CHUNK;
            const float *chunk = panels + (t.panel * K + k0) * PANEL_COLS;
            /* The next chunk in memory is the next piece of work, unless this is the share's last. */
            const int is_final = (stolen || task == schedule.end - 1) && k0 + kc >= K;
            const int64_t points = (t.block_end - t.block_begin) * ((kc + 1) / 2);
            const int64_t pf_lines = is_final ? 0 : (PANEL_ROW_LINES * kc + points - 1) / points;
            const char *prefetch = (const char *)(chunk + kc * PANEL_COLS);
            for (int64_t b = t.block_begin; b < t.block_end; b++) {
                const int64_t m0 = block_row(b, M, schedule.blocks);
                const int64_t rows = block_row(b + 1, M, schedule.blocks) - m0;
                panel_kernels[rows](x + m0 * K + k0, K, chunk, kc, y + m0 * N + t.panel * PANEL_COLS, N,
                                    t.cols, bias == NULL ? NULL : bias + t.panel * PANEL_COLS, k0 == 0,
                                    k0 + kc >= K, prefetch, pf_lines);
                prefetch += (kc + 1) / 2 * pf_lines * 64;
            }
        }
    }
}
#endif


#if defined(__AVX512F__)
/* y[0:ROWS, 0:cols] = bf16(x[0:ROWS, 0:K] . panel * scale + bias), the panel (K+1)/2 pairs x 48; x
 * rows ldx apart, y rows N apart; scale NULL for 1 (the dtype's weights; int8 weights' per-column
 * scales otherwise, int8_panel_tasks). pf_lines lines of `prefetch` are requested every other pair. */
#define PANEL_KERNEL_BF16(ROWS)                                                                \
    static void panel_kernel_bf16_##ROWS(const uint16_t *x, int64_t ldx, const uint16_t *panel,  \
                                         int64_t K, uint16_t *y, int64_t N, int64_t cols,       \
                                         const uint16_t *bias, const float *scale, const char *prefetch, \
                                         int64_t pf_lines) {                                    \
        const int64_t pairs = (K + 1) / 2;                                                     \
        __m512 acc[ROWS][3];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                         \
            for (int j = 0; j < 3; j++) acc[r][j] = _mm512_setzero_ps();                       \
        PANEL_PAIRS_BF16(ROWS)                                                                 \
        for (int j = 0; j < 3; j++) {                                                          \
            const int64_t left = cols - 16 * j;                                                \
            if (left <= 0) break;                                                              \
            const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1u);      \
            const __m512 add = bias == NULL ? _mm512_setzero_ps()                              \
                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(                 \
                      _mm256_maskz_loadu_epi16(mask, bias + 16 * j)), 16));                    \
            const __m512 mul = scale == NULL ? _mm512_set1_ps(1.0f) : _mm512_maskz_loadu_ps(mask, scale + 16 * j); \
            for (int r = 0; r < ROWS; r++)                                                     \
                _mm256_mask_storeu_epi16(y + r * N + 16 * j, mask,                             \
                                         round_to_bf16(_mm512_add_ps(_mm512_mul_ps(acc[r][j], mul), add))); \
        }                                                                                      \
    }

#if defined(__AVX512BF16__)
/* The pairs of one row of x broadcast as they are, into vdpbf16ps. */
#define PANEL_PAIRS_BF16(ROWS)                                                                 \
        for (int64_t d = 0; d < pairs; d++) {                                                  \
            if ((d & 1) == 0)                                                                  \
                for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1); \
            const uint16_t *w = panel + d * 2 * PANEL_COLS;                                    \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w),                               \
                           w1 = (__m512bh)_mm512_loadu_si512(w + 32),                          \
                           w2 = (__m512bh)_mm512_loadu_si512(w + 64);                          \
            const int half = 2 * d + 1 == K;  /* the last k of an odd K: no pair partner in x */ \
            for (int r = 0; r < ROWS; r++) {                                                   \
                const uint16_t *xk = x + r * ldx + 2 * d;                                      \
                uint32_t pair = xk[0];                                                         \
                if (!half) memcpy(&pair, xk, sizeof pair);                                     \
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);                     \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);                                \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);                                \
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);                                \
            }                                                                                  \
        }
#else
/* Without AVX512-BF16 the arithmetic is fp32: PANEL_WIDE_PAIRS pairs of every row of x at a time
 * widened to fp32 on the stack (so that each k is one broadcast from memory, not a shift per row),
 * each panel vector split into its even and odd k (even_bf16, odd_bf16): 48 FMAs per pair of k
 * for 8 rows, against 24 vdpbf16ps. */
enum { PANEL_WIDE_PAIRS = 64 };
#define PANEL_PAIRS_BF16(ROWS)                                                                 \
        float xs[ROWS][2 * PANEL_WIDE_PAIRS];                                                  \
        for (int64_t d0 = 0; d0 < pairs; d0 += PANEL_WIDE_PAIRS) {                             \
            const int64_t dn = pairs - d0 < PANEL_WIDE_PAIRS ? pairs - d0 : PANEL_WIDE_PAIRS;   \
            const int64_t k0 = 2 * d0, kn = K - k0 < 2 * dn ? K - k0 : 2 * dn;                 \
            for (int r = 0; r < ROWS; r++)                                                     \
                for (int64_t k = 0; k < 2 * dn; k += 16) {                                     \
                    const __mmask16 in = kn - k >= 16 ? 0xFFFF : kn <= k ? 0 : (__mmask16)((1u << (kn - k)) - 1u); \
                    _mm512_storeu_ps(xs[r] + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
                        _mm256_maskz_loadu_epi16(in, x + r * ldx + k0 + k)), 16)));           \
                }                                                                              \
            for (int64_t d = d0; d < d0 + dn; d++) {                                           \
                if ((d & 1) == 0)                                                              \
                    for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1); \
                const uint16_t *w = panel + d * 2 * PANEL_COLS;                                \
                const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32),      \
                              w2 = _mm512_loadu_si512(w + 64);                                 \
                const __m512 e0 = even_bf16(w0), e1 = even_bf16(w1), e2 = even_bf16(w2);       \
                const __m512 o0 = odd_bf16(w0), o1 = odd_bf16(w1), o2 = odd_bf16(w2);          \
                for (int r = 0; r < ROWS; r++) {                                               \
                    const __m512 be = _mm512_set1_ps(xs[r][2 * (d - d0)]);                     \
                    const __m512 bo = _mm512_set1_ps(xs[r][2 * (d - d0) + 1]);                 \
                    acc[r][0] = _mm512_fmadd_ps(bo, o0, _mm512_fmadd_ps(be, e0, acc[r][0]));   \
                    acc[r][1] = _mm512_fmadd_ps(bo, o1, _mm512_fmadd_ps(be, e1, acc[r][1]));   \
                    acc[r][2] = _mm512_fmadd_ps(bo, o2, _mm512_fmadd_ps(be, e2, acc[r][2]));   \
                }                                                                              \
            }                                                                                  \
        }
#endif
PANEL_KERNEL_BF16(1) PANEL_KERNEL_BF16(2) PANEL_KERNEL_BF16(3) PANEL_KERNEL_BF16(4)
PANEL_KERNEL_BF16(5) PANEL_KERNEL_BF16(6) PANEL_KERNEL_BF16(7) PANEL_KERNEL_BF16(8)
#undef PANEL_KERNEL_BF16
#undef PANEL_PAIRS_BF16

typedef void (*panel_kernel_bf16_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *,
                                     int64_t, int64_t, const uint16_t *, const float *, const char *, int64_t);
static const panel_kernel_bf16_fn panel_kernels_bf16[PANEL_ROWS + 1] = {
    NULL, panel_kernel_bf16_1, panel_kernel_bf16_2, panel_kernel_bf16_3, panel_kernel_bf16_4,
    panel_kernel_bf16_5, panel_kernel_bf16_6, panel_kernel_bf16_7, panel_kernel_bf16_8};
#elif defined(SLIPSTREAM_AVX2)
/* The AVX2 bf16 kernel: the fp32 kernel's 6 x 16 block over a bf16 panel packed k-major as the
 * fp32 one is (pack_panels; 32 bytes per k, a line per pair of k), each k's 16 weights widened
 * to two fp32 vectors. Pairs side by side, as the AVX-512 kernels take them, widen into four
 * vectors (even and odd k of each half) that, with two broadcasts, do not fit beside the 12
 * accumulators: GCC kept two of them on the stack. Without the spills it measured the same or
 * slightly faster (Zen 3, linear_kernels.py alternating the two: 64 rows 71.7-72.2 against
 * 65.4-70.7 GFLOP/s, 512 rows 64.6-75.4 against 66.2-71.0), still short of the fp32 kernel's
 * ~90: there the widening (a shuffle and a shift per 8 weights) probably takes turns with the
 * FMAs on the same vector pipes. PANEL_WIDE_PAIRS pairs of every row of x are widened on the
 * stack first, so that each broadcast is one load. */
enum { PANEL_WIDE_PAIRS = 64 };

/* One k of the block (of x's chunk widened from k0), as PANEL_STEP in fp32. Four k per loop step,
 * as there: against one, the bench model's 48 weights alternating in one process (Zen 3), 64 rows
 * 1.12x, 256 rows 1.09x, 1 to 6 rows even (memory-bound); the same products bit for bit. */
#define PANEL_STEP_BF16(ROWS, k)                                                               \
    do {                                                                                       \
        const uint16_t *w = panel + (k0 + (k)) * PANEL_COLS;                                   \
        const __m256 w0 = widen_bf16_8(w), w1 = widen_bf16_8(w + 8);                           \
        UNROLLED for (int r = 0; r < ROWS; r++) {                                              \
            const __m256 b = _mm256_broadcast_ss(&xs[r][k]);                                   \
            acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);                                     \
            acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);                                     \
        }                                                                                      \
    } while (0)

#define PANEL_KERNEL_BF16(ROWS)                                                                \
    static void panel_kernel_bf16_##ROWS(const uint16_t *x, int64_t ldx, const uint16_t *panel,  \
                                         int64_t K, uint16_t *y, int64_t N, int64_t cols,       \
                                         const uint16_t *bias, const float *scale, const char *prefetch, \
                                         int64_t pf_lines) {                                    \
        const int64_t pairs = (K + 1) / 2;                                                     \
        __m256 acc[ROWS][2];                                                                   \
        UNROLLED for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();    \
        float xs[ROWS][2 * PANEL_WIDE_PAIRS];                                                  \
        for (int64_t d0 = 0; d0 < pairs; d0 += PANEL_WIDE_PAIRS) {                             \
            const int64_t dn = pairs - d0 < PANEL_WIDE_PAIRS ? pairs - d0 : PANEL_WIDE_PAIRS;   \
            const int64_t k0 = 2 * d0, kn = K - k0 < 2 * dn ? K - k0 : 2 * dn;                 \
            UNROLLED for (int r = 0; r < ROWS; r++) {                                          \
                const uint16_t *xr = x + r * ldx + k0;                                         \
                int64_t k = 0;                                                                 \
                for (; k + 8 <= kn; k += 8) _mm256_storeu_ps(xs[r] + k, widen_bf16_8(xr + k));  \
                for (; k < kn; k++) xs[r][k] = bf16_to_f32(xr[k]);                             \
                for (; k < 2 * dn; k++) xs[r][k] = 0.0f;                                       \
            }                                                                                  \
            int64_t k = 0;                                                                     \
            for (; k + PANEL_UNROLL <= 2 * dn; k += PANEL_UNROLL) {  /* requests per 4 k */   \
                for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1); \
                UNROLLED for (int u = 0; u < PANEL_UNROLL; u++) PANEL_STEP_BF16(ROWS, k + u);  \
            }                                                                                  \
            for (; k < 2 * dn; k++) PANEL_STEP_BF16(ROWS, k);                                  \
        }                                                                                      \
        UNROLLED for (int j = 0; j < 2; j++) {                                                 \
            const int64_t left = cols - 8 * j < 8 ? cols - 8 * j : 8;                          \
            if (left <= 0) break;                                                              \
            float add[8] = {0}, mul[8] = {1, 1, 1, 1, 1, 1, 1, 1};                             \
            for (int64_t i = 0; bias != NULL && i < left; i++) add[i] = bf16_to_f32(bias[8 * j + i]); \
            for (int64_t i = 0; scale != NULL && i < left; i++) mul[i] = scale[8 * j + i];     \
            UNROLLED for (int r = 0; r < ROWS; r++) {                                          \
                uint16_t out[8];                                                               \
                const __m256 scaled = _mm256_mul_ps(acc[r][j], _mm256_loadu_ps(mul));          \
                _mm_storeu_si128((__m128i *)out, round_to_bf16_8(_mm256_add_ps(scaled, _mm256_loadu_ps(add)))); \
                memcpy(y + r * N + 8 * j, out, left * sizeof(uint16_t));                       \
            }                                                                                  \
        }                                                                                      \
    }
PANEL_KERNEL_BF16(1) PANEL_KERNEL_BF16(2) PANEL_KERNEL_BF16(3)
PANEL_KERNEL_BF16(4) PANEL_KERNEL_BF16(5) PANEL_KERNEL_BF16(6)
#undef PANEL_KERNEL_BF16
#undef PANEL_STEP_BF16


typedef void (*panel_kernel_bf16_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *,
                                     int64_t, int64_t, const uint16_t *, const float *, const char *, int64_t);
static const panel_kernel_bf16_fn panel_kernels_bf16[PANEL_ROWS + 1] = {
    NULL, panel_kernel_bf16_1, panel_kernel_bf16_2, panel_kernel_bf16_3, panel_kernel_bf16_4,
    panel_kernel_bf16_5, panel_kernel_bf16_6};
#endif

#if defined(HAS_PANEL_KERNEL)

static void panel_tasks_bf16(task_team *team, const uint16_t *x, const uint16_t *panels, const uint16_t *bias,
                             uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const panel_schedule schedule = thread_panel_schedule(M, N, PANEL_ROWS);
    const int64_t pairs = (K + 1) / 2, panel_elems = 2 * pairs * PANEL_COLS;
    open_share(team, schedule.begin, schedule.end);
    int stolen = 0;
    int64_t task;
    while (next_task(team, &stolen, &task)) {
        const panel_task t = panel_task_at(&schedule, task, N);
        const uint16_t *panel = panels + t.panel * panel_elems;
        /* The next panel in memory is the next piece of work, unless this is the share's last task. */
        const int64_t points = (t.block_end - t.block_begin) * ((pairs + 1) / 2);
        const int64_t pf_lines = stolen || task == schedule.end - 1
                                     ? 0 : (PANEL_ROW_LINES * pairs + points - 1) / points;
        const char *prefetch = (const char *)(panel + panel_elems);
        for (int64_t b = t.block_begin; b < t.block_end; b++) {
            const int64_t m0 = block_row(b, M, schedule.blocks);
            const int64_t rows = block_row(b + 1, M, schedule.blocks) - m0;
            panel_kernels_bf16[rows](x + m0 * K, K, panel, K, y + m0 * N + t.panel * PANEL_COLS, N, t.cols,
                                     bias == NULL ? NULL : bias + t.panel * PANEL_COLS, NULL, prefetch, pf_lines);
            prefetch += (pairs + 1) / 2 * pf_lines * 64;
        }
    }
}
#endif

#if defined(SLIPSTREAM_AMX)
/*
 * bf16 products on AMX tiles (common.h). The bf16 panels (pairs of consecutive k side by side,
 * 48 columns) are already the weight tiles' layout: rows of 16 columns x 2 k, 192 bytes apart. A
 * block of up to 16 rows keeps its 16 x 48 sums in three tiles; per 32 k it loads one tile of x
 * and three of the panel. vdpbf16ps, which the kernels above use, reached only ~210 GFLOP/s here
 * (an Intel Xeon of family 6, model 167, 2 cores; benchmarks/linear_kernels.py), against ~700 for
 * oneDNN's AMX product at 64 rows. Where K is not a multiple of 32, the vdpbf16ps kernels run.
 */
enum { AMX_ROWS = 16, AMX_K = 32 };

/* The tiles for blocks of `rows` rows: 0-2 the sums, 3 the rows of x, 4-6 the panel's three column
 * tiles. */
static void configure_tiles(int64_t rows) {
    configure_amx(rows, 3, 1, 3);
}

/* y[0:rows, 0:cols] = bf16(x[0:rows, 0:K] . panel + bias) as panel_kernel_bf16_*, for the rows the
 * tiles are configured for; pf_lines lines of `prefetch` requested per 32 k. */
static void amx_block_bf16(const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t K, uint16_t *y,
                           int64_t N, int64_t rows, int64_t cols, const uint16_t *bias, const char *prefetch,
                           int64_t pf_lines) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < K; k += AMX_K) {
        for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
        const uint16_t *w = panel + k * PANEL_COLS;  /* pair k / 2, 2 x 48 values per pair */
        _tile_loadd(3, x + k, ldx * 2);
        _tile_loadd(4, w, 4 * PANEL_COLS);
        _tile_loadd(5, w + 32, 4 * PANEL_COLS);
        _tile_loadd(6, w + 64, 4 * PANEL_COLS);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    float sums[AMX_ROWS][PANEL_COLS];
    _tile_stored(0, sums[0], sizeof sums[0]);
    _tile_stored(1, sums[0] + 16, sizeof sums[0]);
    _tile_stored(2, sums[0] + 32, sizeof sums[0]);
    for (int j = 0; j < 3; j++) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 add = bias == NULL ? _mm512_setzero_ps()
            : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                  _mm256_maskz_loadu_epi16(mask, bias + 16 * j)), 16));
        for (int64_t r = 0; r < rows; r++)
            _mm256_mask_storeu_epi16(y + r * N + 16 * j, mask,
                                     round_to_bf16(_mm512_add_ps(_mm512_loadu_ps(sums[r] + 16 * j), add)));
    }
}

/* panel_tasks_bf16 on the tiles: the same panels and work stealing, blocks of up to 16 rows. */
static void panel_tasks_amx(task_team *team, const uint16_t *x, const uint16_t *panels, const uint16_t *bias,
                            uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const panel_schedule schedule = thread_panel_schedule(M, N, AMX_ROWS);
    const int64_t panel_elems = K * PANEL_COLS, steps = K / AMX_K;
    open_share(team, schedule.begin, schedule.end);
    int64_t configured = 0, task;
    int stolen = 0;
    while (next_task(team, &stolen, &task)) {
        const panel_task t = panel_task_at(&schedule, task, N);
        const uint16_t *panel = panels + t.panel * panel_elems;
        const int64_t points = (t.block_end - t.block_begin) * steps;
        const int64_t pf_lines = stolen || task == schedule.end - 1
                                     ? 0 : (PANEL_ROW_LINES * K / 2 + points - 1) / points;
        const char *prefetch = (const char *)(panel + panel_elems);
        for (int64_t b = t.block_begin; b < t.block_end; b++) {
            const int64_t m0 = block_row(b, M, schedule.blocks);
            const int64_t rows = block_row(b + 1, M, schedule.blocks) - m0;
            if (rows != configured) configure_tiles(configured = rows);
            amx_block_bf16(x + m0 * K, K, panel, K, y + m0 * N + t.panel * PANEL_COLS, N, rows, t.cols,
                           bias == NULL ? NULL : bias + t.panel * PANEL_COLS, prefetch, pf_lines);
            prefetch += steps * pf_lines * 64;
        }
    }
    if (configured) _tile_release();
}
#endif

/* Whether bf16 products of (., K) inputs run on the AMX tiles here. */
static int amx_takes(int64_t K) {
#if defined(SLIPSTREAM_AMX)
    return K % AMX_K == 0 && amx_granted();
#else
    (void)K;
    return 0;
#endif
}

/* Whether this build and process multiply bf16 on AMX tiles (for inputs whose K is a multiple of 32). */
int panel_gemm_uses_amx(void) {
    return amx_takes(32);
}

/* From PANEL_BANDS_FROM_ROWS rows on, rows go in bands of PANEL_BAND_ROWS: every panel passes
 * over one band (whose x rows stay in L2) before the next band starts, instead of each panel
 * passing over all M rows, whose x then streams from L3 or memory for every panel. fp32, the 48
 * distinct weights of the bench model, outputs preallocated: at M = 2048, 464-473 GFLOP/s in
 * bands of 64 rows, 453 in bands of 256, 427-432 unbanded and 418 for oneDNN; at M = 128-256
 * bands measured slightly slower (436-445 against 447-454). */
enum { PANEL_BAND_ROWS = 64, PANEL_BANDS_FROM_ROWS = 1024 };

/* This thread's part of y = x W^T + b through the panels, inside a parallel region (no barrier
 * at the end); the caller has checked has_panel_gemm(dtype). */
static void panel_tasks(task_team *team, const void *x, const void *panels, const void *bias, void *y,
                        int64_t M, int64_t N, int64_t K, int dtype) {
    const int64_t band = M >= PANEL_BANDS_FROM_ROWS ? PANEL_BAND_ROWS : M;
    for (int64_t m0 = 0; m0 < M; m0 += band) {
        const int64_t rows = M - m0 < band ? M - m0 : band;
#if defined(HAS_PANEL_KERNEL)
        if (dtype == DTYPE_F32)
            panel_tasks_f32(team, (const float *)x + m0 * K, panels, bias, (float *)y + m0 * N, rows, N, K);
#if defined(SLIPSTREAM_AMX)
        else if (amx_takes(K))
            panel_tasks_amx(team, (const uint16_t *)x + m0 * K, panels, bias, (uint16_t *)y + m0 * N, rows,
                            N, K);
#endif
        else
            panel_tasks_bf16(team, (const uint16_t *)x + m0 * K, panels, bias, (uint16_t *)y + m0 * N, rows,
                             N, K);
#endif
        (void)rows;
    }
    (void)team; (void)x; (void)panels; (void)bias; (void)y; (void)N; (void)K; (void)dtype;
}

/* Returns 0, or 2 where this build has no panel kernel for the dtype (see has_panel_gemm). */
int panel_gemm(const void *x, const void *panels, const void *bias, void *y, int64_t M, int64_t N,
               int64_t K, int dtype, int num_threads) {
    if (!has_panel_gemm(dtype)) return 2;
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        task_team team = team_of(shares);
        panel_tasks(&team, x, panels, bias, y, M, N, K, dtype);
    }
    return 0;
}

/*
 * Weight-only int8 products (ops/quant.py): y (M, N) = s * (x (M, K) q^T) + bias, q int8 (N, K) with
 * one fp32 scale s[n] per output feature, x and y fp32 or bf16. The int8 values are widened to fp32
 * in registers (exact: |q| <= 127) and multiplied in fp32, each output scaled once after its sum
 * and rounded once to the dtype, as Int8Linear's plain forward computes it; only the order of the
 * sums differs. The weight is kept once, in int8 panels of PANEL_COLS output features, k-major
 * (panels[p][k][j] = q[p * PANEL_COLS + j][k], zero past N): per k, PANEL_COLS weights widened to
 * fp32 (three vectors with AVX-512, two with AVX2) against one broadcast x value per row of a
 * block of up to PANEL_ROWS rows, as the fp32 panel kernel does, so that the widening is shared by
 * the block's rows. A panel (K x 48 bytes: 96 KiB at K = 2,048) stays in L2 while the blocks pass
 * over it, so its sums stay in registers for all of K. bf16 rows of x are widened INT8_X_CHUNK
 * values of k at a time onto the stack.
 *
 * One kernel for every row count, batch-1 decode included: a matrix-vector kernel over a row-major
 * int8 copy (each thread streaming whole rows, each weight vector shared by up to 4 rows of x)
 * measured no faster at one row (the bench model's 48 weights: 3.2-4.0 against 3.0-3.2 ms a pass)
 * and slower at 2 and 4 (4.4-4.6 against 3.2 ms, 5.6-6.9 against 4.1-4.4), and a second copy would
 * give back the memory the int8 weights save.
 */
#if defined(HAS_PANEL_KERNEL)
#define INT8_UNROLLED _Pragma("GCC unroll 8")
#if defined(__AVX512F__)
typedef __m512 vec_f32;
enum { VEC_LANES = 16 };
static inline vec_f32 vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec_f32 vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec_f32 vec_fma(vec_f32 a, vec_f32 b, vec_f32 c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec_f32 vec_int8(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
static inline vec_f32 vec_act(const void *x, int64_t i, int dtype) { return load16(x, i, dtype); }
static inline void vec_store(float *p, vec_f32 v) { _mm512_storeu_ps(p, v); }
#else
typedef __m256 vec_f32;
enum { VEC_LANES = 8 };
static inline vec_f32 vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec_f32 vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec_f32 vec_fma(vec_f32 a, vec_f32 b, vec_f32 c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec_f32 vec_int8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
static inline vec_f32 vec_act(const void *x, int64_t i, int dtype) {
    return dtype == DTYPE_F32 ? _mm256_loadu_ps((const float *)x + i) : widen_bf16_8((const uint16_t *)x + i);
}
static inline void vec_store(float *p, vec_f32 v) { _mm256_storeu_ps(p, v); }
#endif
enum { PANEL_VECS = PANEL_COLS / VEC_LANES, INT8_X_CHUNK = 128 };

static inline float act_value(const void *x, int64_t i, int dtype) {
    return dtype == DTYPE_F32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
}

/* n bf16 values of x from element `at`, widened to fp32 into dst. */
static inline void widen_row(float *dst, const void *x, int64_t at, int64_t n) {
    int64_t k = 0;
    for (; k + VEC_LANES <= n; k += VEC_LANES) vec_store(dst + k, vec_act(x, at + k, DTYPE_BF16));
    for (; k < n; k++) dst[k] = act_value(x, at + k, DTYPE_BF16);
}

/* y[i] = dtype(sum * scale + bias[n]): scaled once, after the sum, as Int8Linear's plain forward. */
static inline void store_scaled(void *y, int64_t i, float sum, float scale, const void *bias, int64_t n,
                                int dtype) {
    float value = sum * scale;
    if (bias != NULL) value += act_value(bias, n, dtype);
    if (dtype == DTYPE_F32) ((float *)y)[i] = value;
    else ((uint16_t *)y)[i] = f32_to_bf16(value);
}

/* y[0:ROWS, 0:cols] = s * (x[0:ROWS, 0:K] . panel) + bias, x rows ldx apart, y rows N apart;
 * pf_lines lines of `prefetch` requested every other k. */
#define INT8_PANEL_KERNEL(ROWS)                                                                        \
    static void int8_panel_kernel_##ROWS(const void *x, int64_t ldx, const int8_t *panel, int64_t K,      \
                                         void *y, int64_t N, int64_t cols, const float *scale,           \
                                         const void *bias, int dtype, const char *prefetch,            \
                                         int64_t pf_lines) {                                           \
        vec_f32 acc[ROWS][PANEL_VECS];                                                                 \
        INT8_UNROLLED for (int r = 0; r < ROWS; r++)                                                   \
            INT8_UNROLLED for (int j = 0; j < PANEL_VECS; j++) acc[r][j] = vec_zero();                 \
        float xs[ROWS][INT8_X_CHUNK];                                                                  \
        for (int64_t k0 = 0; k0 < K; k0 += INT8_X_CHUNK) {                                             \
            const int64_t kn = K - k0 < INT8_X_CHUNK ? K - k0 : INT8_X_CHUNK;                          \
            const float *xk = (const float *)x + k0;                                                   \
            int64_t ld = ldx;                                                                          \
            if (dtype != DTYPE_F32) {                                                                  \
                for (int r = 0; r < ROWS; r++) widen_row(xs[r], x, r * ldx + k0, kn);                  \
                xk = xs[0];                                                                            \
                ld = INT8_X_CHUNK;                                                                     \
            }                                                                                          \
            const int8_t *w = panel + k0 * PANEL_COLS;                                                 \
            for (int64_t k = 0; k < kn; k++, w += PANEL_COLS) {                                        \
                if ((k & 1) == 0)                                                                      \
                    for (int64_t l = 0; l < pf_lines; l++, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1); \
                vec_f32 wv[PANEL_VECS];                                                                \
                INT8_UNROLLED for (int j = 0; j < PANEL_VECS; j++) wv[j] = vec_int8(w + j * VEC_LANES);  \
                INT8_UNROLLED for (int r = 0; r < ROWS; r++) {                                         \
                    const vec_f32 b = vec_set1(xk[r * ld + k]);                                        \
                    INT8_UNROLLED for (int j = 0; j < PANEL_VECS; j++) acc[r][j] = vec_fma(b, wv[j], acc[r][j]); \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        float sums[PANEL_COLS];                                                                        \
        for (int r = 0; r < ROWS; r++) {                                                               \
            INT8_UNROLLED for (int j = 0; j < PANEL_VECS; j++) vec_store(sums + j * VEC_LANES, acc[r][j]); \
            for (int64_t c = 0; c < cols; c++)                                                         \
                store_scaled(y, r * N + c, sums[c], scale[c], bias, c, dtype);                   \
        }                                                                                              \
    }
INT8_PANEL_KERNEL(1) INT8_PANEL_KERNEL(2) INT8_PANEL_KERNEL(3) INT8_PANEL_KERNEL(4)
INT8_PANEL_KERNEL(5) INT8_PANEL_KERNEL(6)
#if defined(__AVX512F__)  /* PANEL_ROWS 8 */
INT8_PANEL_KERNEL(7) INT8_PANEL_KERNEL(8)
#endif
#undef INT8_PANEL_KERNEL

typedef void (*int8_panel_kernel_fn)(const void *, int64_t, const int8_t *, int64_t, void *, int64_t, int64_t,
                                     const float *, const void *, int, const char *, int64_t);
static const int8_panel_kernel_fn int8_panel_kernels[PANEL_ROWS + 1] = {
    NULL, int8_panel_kernel_1, int8_panel_kernel_2, int8_panel_kernel_3, int8_panel_kernel_4,
    int8_panel_kernel_5, int8_panel_kernel_6,
#if defined(__AVX512F__)  /* PANEL_ROWS 8 */
    int8_panel_kernel_7, int8_panel_kernel_8,
#endif
};

#if defined(__AVX512BF16__)
/*
 * bf16 rows of x with AVX512-BF16, from INT8_PAIRS_FROM_ROWS rows: the fp32 FMAs above do half the
 * multiply-adds per instruction of the dtype's vdpbf16ps kernel (the bench model's 48 weights at 64
 * rows: ~200 against ~390 GFLOP/s), so each task's int8 panel is first written out as bf16 pairs
 * (the values q, exact in bf16; the layout pack_panels gives a bf16 weight) into this thread's
 * scratch, and the dtype's kernel runs over it with the scales in its final step. The conversion,
 * once per panel, is shared by all the task's blocks of rows: against the loop below, alternating
 * in one process (Zen 4, 2 threads, the other core's work varying), 1.5-1.7x at 8 and 16 rows,
 * 1.1-1.2x at 64 and 256; below 8 rows about even or slower (0.4x at one row, 0.9x at 6).
 */
enum { INT8_PAIRS_FROM_ROWS = 8 };

/* The int8 panel (K x PANEL_COLS, k-major) as bf16 pairs, pairs[d][j][e] = q[2d + e][j] (0 past K):
 * each int8 widened to fp32, whose upper half is then its exact bf16. */
static void int8_panel_as_bf16_pairs(const int8_t *panel, int64_t K, uint16_t *pairs) {
    for (int64_t d = 0; d < (K + 1) / 2; d++)
        for (int j = 0; j < PANEL_COLS; j += 16) {
            const __m512 even = vec_int8(panel + 2 * d * PANEL_COLS + j);
            const __m512 odd = 2 * d + 1 < K ? vec_int8(panel + (2 * d + 1) * PANEL_COLS + j) : _mm512_setzero_ps();
            const __m512i both = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                                 _mm512_castps_si512(odd));  /* odd's lower half is 0 */
            _mm512_storeu_si512(pairs + 2 * (d * PANEL_COLS + j), both);
        }
}

/* int8_panel_tasks for bf16 rows through the dtype's kernel; returns 0 where this thread's scratch
 * could not be allocated: then the caller's loop runs instead, with the same tasks (the same
 * schedule), so the threads' steals stay within one loop either way. */
static int int8_pair_tasks(task_team *team, const uint16_t *x, const int8_t *panels, const float *scale,
                           const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const int64_t pairs = (K + 1) / 2;
    uint16_t *scratch = malloc(pairs * 2 * PANEL_COLS * sizeof(uint16_t));
    if (scratch == NULL) return 0;
    const panel_schedule schedule = thread_panel_schedule(M, N, PANEL_ROWS);
    open_share(team, schedule.begin, schedule.end);
    int stolen = 0;
    int64_t task;
    while (next_task(team, &stolen, &task)) {
        const panel_task t = panel_task_at(&schedule, task, N);
        const int8_t *panel = panels + t.panel * K * PANEL_COLS;
        int8_panel_as_bf16_pairs(panel, K, scratch);
        const int64_t n0 = t.panel * PANEL_COLS;
        /* The next int8 panel in memory is the next piece of work, unless this is the share's last. */
        const int64_t points = (t.block_end - t.block_begin) * ((pairs + 1) / 2);
        const int64_t lines = (K * PANEL_COLS + 63) / 64;
        const int64_t pf_lines = stolen || task == schedule.end - 1 ? 0 : (lines + points - 1) / points;
        const char *prefetch = (const char *)(panel + K * PANEL_COLS);
        for (int64_t b = t.block_begin; b < t.block_end; b++) {
            const int64_t m0 = block_row(b, M, schedule.blocks);
            const int64_t rows = block_row(b + 1, M, schedule.blocks) - m0;
            panel_kernels_bf16[rows](x + m0 * K, K, scratch, K, y + m0 * N + n0, N, t.cols,
                                     bias == NULL ? NULL : bias + n0, scale + n0, prefetch, pf_lines);
            prefetch += (pairs + 1) / 2 * pf_lines * 64;
        }
    }
    free(scratch);
    return 1;
}
#endif

/* Below this many rows the int8 panels stream faster on the hardware prefetcher alone: the bench
 * model's 48 weights without the requests, alternating with them in one process (Zen 4, bf16 and
 * fp32), 1.01-1.1x at one and two rows, mixed at 3 (0.93-1.15x), 0.92-0.98x at 4 and 0.72-0.99x
 * from 8 to 64. */
enum { INT8_PREFETCH_FROM_ROWS = 3 };

/* This thread's part of the int8 product, inside a parallel region (no barrier at the end): the
 * panel tasks and stealing of panel_tasks_f32, rows in bands from PANEL_BANDS_FROM_ROWS as there. */
static void int8_panel_tasks(task_team *team, const void *x, const int8_t *panels, const float *scale,
                             const void *bias, void *y, int64_t M, int64_t N, int64_t K, int dtype) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    const int64_t band = M >= PANEL_BANDS_FROM_ROWS ? PANEL_BAND_ROWS : M;
    for (int64_t m_band = 0; m_band < M; m_band += band) {
        const int64_t band_rows = M - m_band < band ? M - m_band : band;
#if defined(__AVX512BF16__)
        if (dtype == DTYPE_BF16 && band_rows >= INT8_PAIRS_FROM_ROWS &&
            int8_pair_tasks(team, (const uint16_t *)x + m_band * K, panels, scale, bias, (uint16_t *)y + m_band * N,
                            band_rows, N, K))
            continue;
#endif
        const panel_schedule schedule = thread_panel_schedule(band_rows, N, PANEL_ROWS);
        open_share(team, schedule.begin, schedule.end);
        int stolen = 0;
        int64_t task;
        while (next_task(team, &stolen, &task)) {
            const panel_task t = panel_task_at(&schedule, task, N);
            const int8_t *panel = panels + t.panel * K * PANEL_COLS;
            /* The next panel in memory is the next piece of work, unless this is the share's last task;
             * its lines are requested from INT8_PREFETCH_FROM_ROWS rows. */
            const int64_t points = (t.block_end - t.block_begin) * ((K + 1) / 2);
            const int64_t lines = (K * PANEL_COLS + 63) / 64;
            const int64_t pf_lines = stolen || task == schedule.end - 1 || band_rows < INT8_PREFETCH_FROM_ROWS
                                         ? 0 : (lines + points - 1) / points;
            const char *prefetch = (const char *)(panel + K * PANEL_COLS);
            const int64_t n0 = t.panel * PANEL_COLS;
            for (int64_t b = t.block_begin; b < t.block_end; b++) {
                const int64_t m0 = m_band + block_row(b, band_rows, schedule.blocks);
                const int64_t rows = m_band + block_row(b + 1, band_rows, schedule.blocks) - m0;
                int8_panel_kernels[rows]((const char *)x + m0 * K * elem, K, panel, K,
                                         (char *)y + (m0 * N + n0) * elem, N, t.cols, scale + n0,
                                         bias == NULL ? NULL : (const char *)bias + n0 * elem, dtype, prefetch,
                                         pf_lines);
                prefetch += (K + 1) / 2 * pf_lines * 64;
            }
        }
    }
}
#endif

/* Whether this build has the int8 kernels (AVX-512, or AVX2 with FMA, as the panel kernel). */
int has_int8_gemm(void) {
#if defined(HAS_PANEL_KERNEL)
    return 1;
#else
    return 0;
#endif
}

/* Elements (bytes) of the int8 panel copy of an (N, K) int8 weight. */
int64_t int8_panel_numel(int64_t N, int64_t K) {
    return (N + PANEL_COLS - 1) / PANEL_COLS * PANEL_COLS * K;
}

void pack_int8_panels(const int8_t *W, int8_t *panels, int64_t N, int64_t K, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < (N + PANEL_COLS - 1) / PANEL_COLS; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PANEL_COLS; j++) {
                const int64_t n = p * PANEL_COLS + j;
                panels[(p * K + k) * PANEL_COLS + j] = n < N ? W[n * K + k] : 0;
            }
}

/* y = s * (x q^T) + bias for any M over pack_int8_panels' copy. Returns 0, or 2 where this build
 * has no int8 kernels. */
int int8_panel_gemm(const void *x, const int8_t *panels, const float *scale, const void *bias, void *y,
                    int64_t M, int64_t N, int64_t K, int dtype, int num_threads) {
    if (!has_int8_gemm()) return 2;
#if defined(HAS_PANEL_KERNEL)
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        task_team team = team_of(shares);
        int8_panel_tasks(&team, x, panels, scale, bias, y, M, N, K, dtype);
    }
#else
    (void)x; (void)panels; (void)scale; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)dtype;
    (void)num_threads;
#endif
    return 0;
}

/* n activations (dtype: bits 0-3 of a cache dtype argument) stored as a cache row: the same bytes
 * for a cache of their dtype, else each value converted to fp8 (f32_bits_to_fp8, as the PyTorch path). */
static inline void store_cache_row(void *dst, const void *src, int64_t n, int dtype) {
    const int q = q_dtype_of(dtype), kv = dtype >> 4;
    if (kv == 0) {
        memcpy(dst, src, n * (q == DTYPE_F32 ? 4 : 2));
        return;
    }
    uint8_t *out = dst;
    if (q == DTYPE_F32)
        for (int64_t i = 0; i < n; i++) out[i] = f32_bits_to_fp8(((const uint32_t *)src)[i], kv);
    else
        for (int64_t i = 0; i < n; i++) out[i] = f32_bits_to_fp8((uint32_t)((const uint16_t *)src)[i] << 16, kv);
}

/*
 * Stores new tokens' keys and values at their cache slots: row t of k and v (num_kv_heads x
 * head_dim values, k_stride and v_stride elements after row t - 1: the keys and values can be
 * read where the fused q/k/v product left them) goes to row slots[t] of k_cache and v_cache, in
 * the cache's dtype (dtype: fp32 or bf16 activations, an fp8 cache in bits 4-7). One call for both,
 * instead of two index_copy_ dispatches per layer; the rows land in lines not yet in cache, so a
 * batch's writes are shared among the threads. Returns 0, or 2 for a dtype argument it does not take.
 */
int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
             int64_t num_tokens, int64_t row_elems, int64_t k_stride, int64_t v_stride, int dtype,
             int num_threads) {
    if (!valid_cache_dtype(dtype)) return 2;
    const int64_t elem = q_dtype_of(dtype) == DTYPE_F32 ? 4 : 2, row_bytes = row_elems * kv_elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < num_tokens; t++) {
        store_cache_row((char *)k_cache + slots[t] * row_bytes, (const char *)k + t * k_stride * elem, row_elems,
                        dtype);
        store_cache_row((char *)v_cache + slots[t] * row_bytes, (const char *)v + t * v_stride * elem, row_elems,
                        dtype);
    }
    return 0;
}

/*
 * RMSNorm over the last dimension, numerically as Hugging Face's Llama computes it: in fp32,
 * x * rsqrt(mean(x^2) + eps) rounded to the activation dtype, then times the weight in the
 * activation dtype (for bf16 that is a second rounding, which we reproduce).
 * x, out: (num_rows, dim); weight: (dim,). out may alias x.
 */
/* 1 / sqrt(mean(x^2) + eps) of one row, summed in fp32 in index order. */
static inline __attribute__((always_inline)) float inverse_rms(const void *x, int64_t dim, float eps,
                                                               int dtype) {
    float sum_sq = 0.0f;
    if (dtype == DTYPE_F32) {
        const float *row = x;
        for (int64_t d = 0; d < dim; d++) sum_sq += row[d] * row[d];
    } else {
        const uint16_t *row = x;
        for (int64_t d = 0; d < dim; d++) sum_sq += bf16_to_f32(row[d]) * bf16_to_f32(row[d]);
    }
    return 1.0f / sqrtf(sum_sq / (float)dim + eps);
}

static __attribute__((noinline)) WIDE_VECTORS void rms_norm_row(const void *x, const void *weight,
                                                                void *out, int64_t dim, float eps,
                                                                int dtype) {
    const float inv = inverse_rms(x, dim, eps, dtype);
    if (dtype == DTYPE_F32) {
        const float *row = x, *w = weight;
        float *dst = out;
        for (int64_t d = 0; d < dim; d++) dst[d] = w[d] * (row[d] * inv);
    } else {
        const uint16_t *row = x, *w = weight;
        uint16_t *dst = out;
        for (int64_t d = 0; d < dim; d++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(row[d]) * inv));
            dst[d] = f32_to_bf16(bf16_to_f32(w[d]) * normed);
        }
    }
}

/* Gemma's RMSNorm (GemmaRMSNorm): x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32 (the
 * weight widened), rounded to the activation dtype once at the end. out may alias x. */
static __attribute__((noinline)) WIDE_VECTORS void gemma_rms_norm_row(const void *x, const void *weight,
                                                                      void *out, int64_t dim, float eps,
                                                                      int dtype) {
    const float inv = inverse_rms(x, dim, eps, dtype);
    if (dtype == DTYPE_F32) {
        const float *row = x, *w = weight;
        float *dst = out;
        for (int64_t d = 0; d < dim; d++) dst[d] = (row[d] * inv) * (1.0f + w[d]);
    } else {
        const uint16_t *row = x, *w = weight;
        uint16_t *dst = out;
        for (int64_t d = 0; d < dim; d++)
            dst[d] = f32_to_bf16((bf16_to_f32(row[d]) * inv) * (1.0f + bf16_to_f32(w[d])));
    }
}

typedef void (*norm_row_fn)(const void *, const void *, void *, int64_t, float, int);

/* one_plus_weight: Gemma's norm (gemma_rms_norm_row), else Llama's (rms_norm_row). */
void rms_norm(const void *x, const void *weight, void *out, int64_t num_rows, int64_t dim,
              float eps, int one_plus_weight, int dtype, int num_threads) {
    const int64_t row_bytes = dim * (dtype == DTYPE_F32 ? 4 : 2);
    const norm_row_fn norm = one_plus_weight ? gemma_rms_norm_row : rms_norm_row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= MIN_PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++)
        norm((const char *)x + r * row_bytes, weight, (char *)out + r * row_bytes, dim, eps, dtype);
}

/* residual += x, each sum rounded to the dtype as PyTorch's `residual + x` rounds it. */
static __attribute__((noinline)) WIDE_VECTORS void add_row(void *residual, const void *x, int64_t dim,
                                                           int dtype) {
    if (dtype == DTYPE_F32) {
        float *sum = residual;
        const float *add = x;
        for (int64_t d = 0; d < dim; d++) sum[d] += add[d];
    } else {
        uint16_t *sum = residual;
        const uint16_t *add = x;
        for (int64_t d = 0; d < dim; d++) sum[d] = f32_to_bf16(bf16_to_f32(sum[d]) + bf16_to_f32(add[d]));
    }
}

/* residual += x (unless x is NULL) as add_row rounds it, then out = rms_norm of the new residual
 * row while it is in L1: one row of add_rms_norm. */
static inline void add_rms_norm_row(void *residual, const void *x, const void *weight, void *out, int64_t dim,
                                    float eps, int dtype) {
    if (x != NULL) add_row(residual, x, dim, dtype);
    rms_norm_row(residual, weight, out, dim, eps, dtype);
}

/*
 * A residual sum and the RMSNorm that reads it, row by row in one pass (vLLM's fused_add_rms_norm).
 * Each result equals the two separate steps'. residual, x, out: (num_rows, dim). one_plus_weight:
 * Gemma's norm, as in rms_norm.
 */
void add_rms_norm(void *residual, const void *x, const void *weight, void *out, int64_t num_rows, int64_t dim,
                  float eps, int one_plus_weight, int dtype, int num_threads) {
    const int64_t row_bytes = dim * (dtype == DTYPE_F32 ? 4 : 2);
    if (one_plus_weight) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= MIN_PARALLEL_ROWS)
        for (int64_t r = 0; r < num_rows; r++) {
            add_row((char *)residual + r * row_bytes, (const char *)x + r * row_bytes, dim, dtype);
            gemma_rms_norm_row((char *)residual + r * row_bytes, weight, (char *)out + r * row_bytes, dim, eps,
                               dtype);
        }
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= MIN_PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++)
        add_rms_norm_row((char *)residual + r * row_bytes, (const char *)x + r * row_bytes, weight,
                         (char *)out + r * row_bytes, dim, eps, dtype);
}

/*
 * Rotary embedding in place, Hugging Face's "rotate_half" pairing over the first rotary_dim
 * dimensions of each head (dimension i with i + rotary_dim / 2; the rest of the head, under a
 * partial rotary factor, is left as it is): x' = x * cos + rotate_half(x) * sin, with the cos/sin
 * tables the model computed (already in the activation dtype). In bf16 each product and the sum
 * round to bf16, as the separate PyTorch ops of the reference do. x: num_tokens rows of
 * num_heads x head_dim values, row_stride elements apart (a token's queries or keys where the
 * fused q/k/v product left them); cos, sin: (num_tokens, rotary_dim), whose two halves are equal.
 */
static __attribute__((noinline)) WIDE_VECTORS void rotary_token(void *x, const void *cos_row,
                                                                const void *sin_row, int64_t num_heads,
                                                                int64_t head_dim, int64_t rotary_dim,
                                                                int dtype) {
    /* One loop over the heads per dtype, each stepping a pointer: with the dtype test inside one
     * head loop, the extra rotary_dim argument cost fp32 ~7% against the whole-head kernel. */
    const int64_t half = rotary_dim / 2;
    if (dtype == DTYPE_F32) {
        const float *c = cos_row, *s = sin_row;
        for (float *v = x, *end = v + num_heads * head_dim; v < end; v += head_dim)
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        return;
    }
    const uint16_t *c = cos_row, *s = sin_row;
    for (uint16_t *v = x, *end = v + num_heads * head_dim; v < end; v += head_dim)
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

void rotary_embedding(void *x, const void *cos_table, const void *sin_table, int64_t num_tokens,
                      int64_t num_heads, int64_t head_dim, int64_t rotary_dim, int64_t row_stride, int dtype,
                      int num_threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= MIN_PARALLEL_ROWS)
    for (int64_t t = 0; t < num_tokens; t++)
        rotary_token((char *)x + t * row_stride * elem,
                     (const char *)cos_table + t * rotary_dim * elem,
                     (const char *)sin_table + t * rotary_dim * elem, num_heads, head_dim, rotary_dim, dtype);
}

/*
 * SwiGLU's activation on a fused gate-and-up projection: out[r, i] = silu(x[r, i]) * x[r, F + i]
 * for x (num_rows, 2F), out (num_rows, F), in one pass instead of three ops (silu, the product,
 * and the copy of the non-contiguous halves). In bf16, silu rounds to bf16 before the product, as
 * F.silu(gate) * up does in PyTorch. Below -ln(FLT_MAX), where exp(-g) overflows, silu is 0 (as
 * g / inf is in PyTorch; finite math must not see the infinity).
 */
static inline float silu(float g) { return g < -88.7228f ? 0.0f : g / (1.0f + expf(-g)); }

#if defined(__AVX512F__)
/* silu() of 16 lanes, through exp16 (common.h): over [-100, 100] within 3 ulp of fp64's silu, and
 * in bf16 equal to PyTorch's F.silu on 3 million values. silu_and_mul at 64 rows of the bench
 * model's 2,048 features, alternating processes (Zen 5): 1.7x (bf16) and 2x (fp32) the loop GCC
 * vectorises around its vector expf. */
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    const __mmask16 live = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.7228f), _CMP_GE_OQ);
    return _mm512_maskz_div_ps(live, g, denominator);
}
#endif

/* Gemma's GeGLU activation, GELU's tanh approximation 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g +
 * 0.044715 g^3), written as g / (1 + exp(-2y)) (the same value: 1 + tanh(y) = 2 / (1 + exp(-2y))),
 * which stays accurate where tanh(y) nears -1 and shares silu's form and its overflow guard. */
static const float GELU_2BETA = 1.5957691216057308f, GELU_KAPPA = 0.044715f;  /* 2 sqrt(2 / pi) */

static inline float gelu_tanh(float g) {
    const float y2 = GELU_2BETA * (g + GELU_KAPPA * g * g * g);
    return y2 < -88.7228f ? 0.0f : g / (1.0f + expf(-y2));
}

#if defined(__AVX512F__)
static inline __m512 gelu_tanh16(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(GELU_2BETA), _mm512_fmadd_ps(_mm512_set1_ps(GELU_KAPPA), cube, g));
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), y2)));
    const __mmask16 live = _mm512_cmp_ps_mask(y2, _mm512_set1_ps(-88.7228f), _CMP_GE_OQ);
    return _mm512_maskz_div_ps(live, g, denominator);
}
#endif

/* act(gate) * up of one row, act silu or (gelu) gelu_tanh: a constant at each call site, so each
 * caller's copy has only its activation. */
static inline __attribute__((always_inline)) void act_and_mul_row(const void *x, void *out, int64_t width,
                                                                  int dtype, const int gelu) {
    int64_t i = 0;
    if (dtype == DTYPE_F32) {
        const float *gate = x, *up = gate + width;
        float *dst = out;
#if defined(__AVX512F__)
        for (; i + 16 <= width; i += 16) {
            const __m512 g = _mm512_loadu_ps(gate + i);
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(gelu ? gelu_tanh16(g) : silu16(g), _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < width; i++) dst[i] = (gelu ? gelu_tanh(gate[i]) : silu(gate[i])) * up[i];
    } else {
        const uint16_t *gate = x, *up = gate + width;
        uint16_t *dst = out;
#if defined(__AVX512F__)
        for (; i + 16 <= width; i += 16) {
            const __m512 g = load16(gate, i, DTYPE_BF16);
            const __m512 activated = widen_bf16_16(round_to_bf16(gelu ? gelu_tanh16(g) : silu16(g)));
            _mm256_storeu_si256((__m256i *)(dst + i),
                                round_to_bf16(_mm512_mul_ps(activated, load16(up, i, DTYPE_BF16))));
        }
#endif
        for (; i < width; i++) {
            const float g = bf16_to_f32(gate[i]);
            const float activated = bf16_to_f32(f32_to_bf16(gelu ? gelu_tanh(g) : silu(g)));
            dst[i] = f32_to_bf16(activated * bf16_to_f32(up[i]));
        }
    }
}

static __attribute__((noinline)) WIDE_VECTORS void silu_and_mul_row(const void *x, void *out, int64_t width,
                                                                    int dtype) {
    act_and_mul_row(x, out, width, dtype, 0);
}

static __attribute__((noinline)) WIDE_VECTORS void gelu_tanh_and_mul_row(const void *x, void *out,
                                                                         int64_t width, int dtype) {
    act_and_mul_row(x, out, width, dtype, 1);
}

/* gelu: Gemma's GeGLU (gelu_tanh_and_mul_row), else SwiGLU's silu_and_mul_row. */
void act_and_mul(const void *x, void *out, int64_t num_rows, int64_t width, int gelu, int dtype,
                 int num_threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    void (*row)(const void *, void *, int64_t, int) = gelu ? gelu_tanh_and_mul_row : silu_and_mul_row;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= MIN_PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++)
        row((const char *)x + r * 2 * width * elem, (char *)out + r * width * elem, width, dtype);
}

/*
 * The index of each row's largest value, as torch.argmax takes it: the first of equal largest
 * values, and the first NaN when a row has one (NaN counts as larger than everything). Greedy
 * sampling takes this over every step's logits: torch's reduction reads a 64 x 32,000 batch at
 * ~3 GB/s (0.64 ms) and wants it in fp32 (a 0.18 ms copy from bf16); this reads bf16 or fp32 as
 * stored, from cache. NaNs are found on the bits: the kernels are built with finite math.
 */
static inline int is_nan_bits(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }

static inline uint32_t value_bits(const void *row, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const uint32_t *)row)[i];
    return (uint32_t)((const uint16_t *)row)[i] << 16;
}

static inline float bits_value(uint32_t bits) {
    union { uint32_t u; float f; } v = {.u = bits};
    return v.f;
}

/* Starting from the first value rather than -inf: finite math may fold comparisons with an infinite
 * constant, not with values read at run time. */
static int64_t argmax_row(const void *row, int64_t n, int dtype) {
    int64_t i = 0;
    float max_value = bits_value(value_bits(row, 0, dtype));
    int nan = 0;
#if defined(__AVX512F__)
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    __m512 max16 = _mm512_set1_ps(max_value);
    __mmask16 nans = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_castps_si512(load16(row, i, dtype));
        nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, magnitude), inf);
        max16 = _mm512_max_ps(max16, _mm512_castsi512_ps(bits));
    }
    nan = nans != 0;
    max_value = _mm512_reduce_max_ps(max16);
#endif
    for (; i < n; i++) {
        const uint32_t bits = value_bits(row, i, dtype);
        nan |= is_nan_bits(bits);
        if (bits_value(bits) > max_value) max_value = bits_value(bits);
    }
    /* The first NaN, or else the first value equal to the largest (-0.0 equals 0.0, as in torch). */
    i = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(max_value);
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_castps_si512(load16(row, i, dtype));
        const __mmask16 hit = nan ? _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, magnitude), inf)
                                  : _mm512_cmp_ps_mask(_mm512_castsi512_ps(bits), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++) {
        const uint32_t bits = value_bits(row, i, dtype);
        if (nan ? is_nan_bits(bits) : bits_value(bits) == max_value) return i;
    }
    return 0;  /* not reached: some value equals the largest */
}

/* x (num_rows, width), width >= 1 -> out (num_rows,). */
void argmax_rows(const void *x, int64_t *out, int64_t num_rows, int64_t width, int dtype,
                 int num_threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_rows >= MIN_PARALLEL_ROWS)
    for (int64_t r = 0; r < num_rows; r++)
        out[r] = argmax_row((const char *)x + r * width * elem, width, dtype);
}

/* Whether an M-row product of the decode graph or an expert takes the matrix-vector kernel over the row-major
 * weight: below min_panel_rows(dtype) rows, and up to MAX_GEMV_ROWS where the weight has no panels. */
static int takes_gemv(const void *panels, int64_t M, int dtype) {
    return (panels == NULL && M <= MAX_GEMV_ROWS) || M < min_panel_rows(dtype);
}

/*
 * The routed experts of a mixture-of-experts block in one call: SparseMoeBlock._routed
 * (slipstream/model/transformer.py) on the optimised model, whose ~45 eager ops per layer and step
 * cost as much host time as the experts' products at a decode batch of 64. As vLLM's CPU
 * cpu_fused_moe and SGLang's CPU fused_experts do it, the (token, choice) pairs are sorted by
 * expert, every pair's input row gathered once, and the gate/up products, the activation and the
 * down products run for all experts in turn inside one parallel region, with a barrier only
 * between the stages (an expert's product starts while the threads finish the previous one's,
 * through the task team's stealing); a final pass sums each token's weighted rows.
 *
 * The result equals _routed's bit for bit: each expert's products go through the kernel that its
 * PackedLinear picks for that many rows (the matrix-vector kernel below min_panel_rows, else the
 * panel kernel, whose rows' sums do not depend on the other rows), the activation through
 * silu_and_mul_row, and each pair's row is multiplied by its weight in fp32 and rounded to the
 * dtype, then added to its token's row of out, rounded, in increasing expert order, as
 * `(outputs * w).to(out.dtype)` and one `index_add_` per expert round them.
 *
 * x (num_tokens, E); expert_ids (num_tokens, top_k), each in [0, num_experts); weights
 * (num_tokens, top_k), fp32 or the dtype (weight_dtype); out (num_tokens, E), added into. Each
 * expert's gate_up (2F, E) and down (E, F) weights: the panel-packed copy, the row-major one
 * (needed where an expert may get fewer than min_panel_rows rows) and the bias, or NULL.
 * max_panel_rows: the most rows an expert's products may take on the panel kernel, 0 for no limit.
 * Returns 0; 1 if the workspace could not be allocated; 2 for a bad shape or a missing copy; 3 for
 * an expert id out of range; 6 where an expert has more than max_panel_rows rows (the caller's
 * other path takes those). All are checked before out is touched.
 */
typedef struct {
    const void *gate_up_rows, *gate_up_panels, *gate_up_bias;
    const void *down_rows, *down_panels, *down_bias;
} moe_expert;

/* y = x W^T + b for one expert's M rows, shared among the threads of the enclosing parallel
 * region: the matrix-vector kernel (which ends at a barrier) or this thread's part of the panel
 * product (no barrier: the threads go on to the next expert's product as they finish). */
static void expert_linear(task_team *team, const void *rows, const void *panels, const void *bias,
                          const void *x, void *y, int64_t M, int64_t N, int64_t K, int dtype) {
    if (takes_gemv(panels, M, dtype))
        gemv_rows(team, rows, x, bias, NULL, y, M, N, K, dtype);
    else
        panel_tasks(team, x, panels, bias, y, M, N, K, dtype);
}

/* y = dtype(float(y) * w) in place, as `(outputs * w).to(out.dtype)` rounds an expert's row. Out of
 * line from add_row, so that no multiply-add joins the product and the sum into one rounding. */
static __attribute__((noinline)) WIDE_VECTORS void scale_row(void *y, float w, int64_t dim, int dtype) {
    if (dtype == DTYPE_F32) {
        float *row = y;
        for (int64_t d = 0; d < dim; d++) row[d] *= w;
    } else {
        uint16_t *row = y;
        for (int64_t d = 0; d < dim; d++) row[d] = f32_to_bf16(bf16_to_f32(row[d]) * w);
    }
}

/* The pairs sorted by expert, stably (a counting sort: an expert's pairs keep their order):
 * order[p] is the flat index t * top_k + j of sorted pair p, position[t * top_k + j] its p, and
 * first[e] expert e's first p, first[num_experts] the number of pairs; cursor: num_experts
 * scratch values. Returns 3 for an expert id out of range. */
static int sort_pairs(const int64_t *expert_ids, int64_t num_pairs, int64_t num_experts, int64_t *order,
                      int64_t *position, int64_t *first, int64_t *cursor) {
    for (int64_t e = 0; e <= num_experts; e++) first[e] = 0;
    for (int64_t i = 0; i < num_pairs; i++) {
        if (expert_ids[i] < 0 || expert_ids[i] >= num_experts) return 3;
        first[expert_ids[i] + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++) {
        first[e + 1] += first[e];
        cursor[e] = first[e];
    }
    for (int64_t i = 0; i < num_pairs; i++) {
        const int64_t p = cursor[expert_ids[i]]++;
        order[p] = i;
        position[i] = p;
    }
    return 0;
}

/* Whether every expert's copies take its rows: 0, or moe_experts' status 2 or 6. */
static int check_experts(const moe_expert *experts, const int64_t *first, int64_t num_experts,
                         int64_t max_panel_rows, int dtype) {
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t rows = first[e + 1] - first[e];
        if (rows == 0) continue;
        const moe_expert *expert = &experts[e];
        if (expert->gate_up_panels == NULL || expert->down_panels == NULL) return 2;
        if (takes_gemv(expert->gate_up_panels, rows, dtype) &&
            (expert->gate_up_rows == NULL || expert->down_rows == NULL))
            return 2;
        if (max_panel_rows > 0 && rows > max_panel_rows) return 6;
    }
    return 0;
}

/* One call's index arrays and per-pair rows: order, position and first as sort_pairs() fills them,
 * cursor its scratch, then per pair its gathered input (E), gate/up product (2F), activation (F)
 * and down product (E), each stage's rows in sorted order. */
typedef struct {
    int64_t *order, *position, *first, *cursor;
    char *gathered, *gate_up, *act, *down;
} moe_scratch;

static int64_t moe_scratch_bytes(int64_t P, int64_t num_experts, int64_t E, int64_t F, int64_t elem) {
    return (2 * P + 2 * num_experts + 1) * (int64_t)sizeof(int64_t) + P * (2 * E + 3 * F) * elem;
}

static moe_scratch moe_scratch_at(char *base, int64_t P, int64_t num_experts, int64_t E, int64_t F,
                                  int64_t elem) {
    moe_scratch s;
    s.order = (int64_t *)base;
    s.position = s.order + P;
    s.first = s.position + P;
    s.cursor = s.first + num_experts + 1;
    s.gathered = (char *)(s.cursor + num_experts);
    s.gate_up = s.gathered + P * E * elem;
    s.act = s.gate_up + P * 2 * F * elem;
    s.down = s.act + P * F * elem;
    return s;
}

/* out += the routed experts' weighted outputs of the P = num_tokens * top_k pairs that sort_pairs()
 * sorted into s, shared among the threads of the enclosing parallel region, which all return with
 * out complete. */
static void moe_expert_tasks(task_team *team, const moe_expert *experts, int64_t num_experts, const void *x,
                             const void *weights, int weight_dtype, void *out, int64_t num_tokens,
                             int64_t top_k, int64_t E, int64_t F, int dtype, const moe_scratch *s) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2, P = num_tokens * top_k;
    const int64_t *order = s->order, *position = s->position, *first = s->first;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++)
        memcpy(s->gathered + p * E * elem, (const char *)x + order[p] / top_k * E * elem, E * elem);
    for (int64_t e = 0; e < num_experts; e++)
        if (first[e + 1] > first[e])
            expert_linear(team, experts[e].gate_up_rows, experts[e].gate_up_panels, experts[e].gate_up_bias,
                          s->gathered + first[e] * E * elem, s->gate_up + first[e] * 2 * F * elem,
                          first[e + 1] - first[e], 2 * F, E, dtype);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++)
        silu_and_mul_row(s->gate_up + p * 2 * F * elem, s->act + p * F * elem, F, dtype);
    for (int64_t e = 0; e < num_experts; e++)
        if (first[e + 1] > first[e])
            expert_linear(team, experts[e].down_rows, experts[e].down_panels, experts[e].down_bias,
                          s->act + first[e] * F * elem, s->down + first[e] * E * elem,
                          first[e + 1] - first[e], E, F, dtype);
#pragma omp barrier
    /* Each token's pairs in sorted order, which is increasing expert order (a token's choices are
     * distinct experts; were they not, the order of index_add_'s calls still). */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t done = -1;
        for (int64_t n = 0; n < top_k; n++) {
            int64_t next = -1;
            for (int64_t j = 0; j < top_k; j++) {
                const int64_t p = position[t * top_k + j];
                if (p > done && (next < 0 || p < next)) next = p;
            }
            const int64_t i = order[next];
            const float w = weight_dtype == DTYPE_F32 ? ((const float *)weights)[i]
                                                      : bf16_to_f32(((const uint16_t *)weights)[i]);
            scale_row(s->down + next * E * elem, w, E, dtype);
            add_row((char *)out + t * E * elem, s->down + next * E * elem, E, dtype);
            done = next;
        }
    }
}

int moe_experts(const moe_expert *experts, int64_t num_experts, const void *x, const int64_t *expert_ids,
                const void *weights, int weight_dtype, void *out, int64_t num_tokens, int64_t top_k,
                int64_t hidden_size, int64_t intermediate_size, int64_t max_panel_rows, int dtype,
                int num_threads) {
    const int64_t E = hidden_size, F = intermediate_size, P = num_tokens * top_k;
    if (num_experts < 1 || num_tokens < 0 || top_k < 1 || top_k > num_experts || E < 1 || F < 1 ||
        !has_panel_gemm(dtype))
        return 2;
    if (P == 0) return 0;
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    char *workspace = malloc(moe_scratch_bytes(P, num_experts, E, F, elem));
    if (workspace == NULL) return 1;
    const moe_scratch s = moe_scratch_at(workspace, P, num_experts, E, F, elem);
    int status = sort_pairs(expert_ids, P, num_experts, s.order, s.position, s.first, s.cursor);
    if (status == 0) status = check_experts(experts, s.first, num_experts, max_panel_rows, dtype);
    if (status != 0) {
        free(workspace);
        return status;
    }
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        task_team team = team_of(shares);
        moe_expert_tasks(&team, experts, num_experts, x, weights, weight_dtype, out, num_tokens, top_k, E, F,
                         dtype, &s);
    }
    free(workspace);
    return 0;
}

/*
 * A mixture-of-experts block's routing in the decode graph, equal bit for bit to the eager ops of
 * SparseMoeBlock (slipstream/model/transformer.py: route, then the shared expert's sigmoid gate) as
 * PyTorch's AVX-512 CPU kernels compute them. These functions are built without fast math: their
 * sums must keep PyTorch's order and their products must not fuse into multiply-adds.
 */

/* Sleef's expf_u10, the exp of PyTorch's vectorised CPU kernels (Vectorized<float>::exp), for one
 * value: the same reduction by ln 2, polynomial and scaling, so the same bits for every float
 * (checked against Sleef_expf16_u10 and Sleef_expf8_u10avx2 of libtorch on every float but NaNs). */
static __attribute__((optimize("no-fast-math"))) float vec_expf(float d) {
    /* Sleef's results past its range (and for a NaN), before q would leave int32's */
    if (d < -104.0f) return 0.0f;
    if (d > 100.0f) return INFINITY;
    if (d != d) return d;
    const float q = rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    const int32_t n = (int32_t)q;
    float s = fmaf(q, -0.693145751953125f, d);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    /* u * 2^n in two steps, so that neither factor overflows or flushes */
    u = u * bits_value((uint32_t)((n >> 1) + 0x7f) << 23);
    return u * bits_value((uint32_t)(n - (n >> 1) + 0x7f) << 23);
}

/* The sum of n fp32 values as PyTorch's vec::reduce_all adds them with 16 lanes: fewer than 16 one
 * after another, else lane l accumulating elements l, l + 16, ... (the tail into the first lanes),
 * then the lanes folded in halves (l + l^8, then ^4, ^2, ^1). */
static __attribute__((optimize("no-fast-math"))) float vec_sum16(const float *v, int64_t n) {
    if (n < 16) {
        float acc = v[0];
        for (int64_t i = 1; i < n; i++) acc = acc + v[i];
        return acc;
    }
    float acc[16], folded[16];
    memcpy(acc, v, sizeof(acc));
    int64_t d = 16;
    for (; d < n - n % 16; d += 16)
        for (int l = 0; l < 16; l++) acc[l] = acc[l] + v[d + l];
    for (int l = 0; l < n - d; l++) acc[l] = acc[l] + v[d + l];
    for (int half = 8; half >= 1; half /= 2) {
        for (int l = 0; l < 16; l++) folded[l] = acc[l] + acc[l ^ half];
        memcpy(acc, folded, sizeof(acc));
    }
    return acc[0];
}

/* torch.softmax(p, -1) of one fp32 row of n in place, as PyTorch's kernel for a contiguous last
 * dimension: exp(x - max), then each times 1 / (their sum). */
static __attribute__((optimize("no-fast-math"))) void vec_softmax(float *p, int64_t n) {
    float max_value = p[0];
    for (int64_t i = 1; i < n; i++) max_value = p[i] > max_value ? p[i] : max_value;
    for (int64_t i = 0; i < n; i++) p[i] = vec_expf(p[i] - max_value);
    const float inverse = 1.0f / vec_sum16(p, n);
    for (int64_t i = 0; i < n; i++) p[i] = p[i] * inverse;
}

/* torch.topk over one row of probabilities (no NaN), as PyTorch's CPU kernel chooses: it places
 * the k-th largest with std::nth_element, then sorts the k - 1 before it with std::sort, so among
 * equal values which index comes out where is set by those algorithms' order of visits. This replays
 * libstdc++'s: introselect (median-of-three pivot moved to the front, unguarded partition) down to
 * ranges of 3, then insertion sort, and std::sort of at most 16 values, an insertion sort
 * (checked against torch.topk on rows of many equal values). */
typedef struct {
    float value;
    int64_t index;
} ranked;

static inline int ranks_before(const ranked *a, const ranked *b) { return a->value > b->value; }

static inline void swap_ranked(ranked *a, ranked *b) {
    const ranked t = *a;
    *a = *b;
    *b = t;
}

static void insertion_sort_ranked(ranked *first, ranked *last) {
    for (ranked *i = first + 1; i < last; i++) {
        const ranked v = *i;
        ranked *hole = i;
        if (ranks_before(&v, first)) {
            memmove(first + 1, first, (size_t)(i - first) * sizeof(ranked));
            hole = first;
        } else {
            for (; ranks_before(&v, hole - 1); hole--) *hole = *(hole - 1);
        }
        *hole = v;
    }
}

/* The median of first[1], the middle and last[-1] moved to first, then [first + 1, last) split
 * around it; returns the cut. */
static ranked *partition_ranked(ranked *first, ranked *last) {
    ranked *a = first + 1, *b = first + (last - first) / 2, *c = last - 1;
    if (ranks_before(a, b))
        swap_ranked(first, ranks_before(b, c) ? b : ranks_before(a, c) ? c : a);
    else
        swap_ranked(first, ranks_before(a, c) ? a : ranks_before(b, c) ? c : b);
    ranked *low = first + 1, *high = last;
    for (;;) {
        while (ranks_before(low, first)) low++;
        high--;
        while (ranks_before(first, high)) high--;
        if (low >= high) return low;
        swap_ranked(low, high);
        low++;
    }
}

/* row (n) reordered as torch.topk leaves it for 1 <= k <= 17 and k * 64 > n (where torch selects
 * with nth_element, not partial_sort): its first k are the top k, in torch's order. Returns 0, or 7
 * where libstdc++ would fall back to a heap select (past 2 log2(n) partitions), not replayed. */
static int torch_top_k(ranked *row, int64_t n, int64_t k) {
    ranked *first = row, *last = row + n, *nth = row + k - 1;
    int depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) depth += 2;
    while (last - first > 3) {
        if (depth-- == 0) return 7;
        ranked *cut = partition_ranked(first, last);
        if (cut <= nth)
            first = cut;
        else
            last = cut;
    }
    insertion_sort_ranked(first, last);
    insertion_sort_ranked(row, row + k - 1);
    return 0;
}

/* One token's routing (transformer.route): the top_k experts by the softmax (fp32) of its router
 * logits, in torch.topk's order (torch_top_k), into ids, and their weights into weights (fp32):
 * renormalised to sum to 1 where `renormalize` (their sum taken one after another, as torch sums
 * up to 4 or exactly 8 values of a row), then rounded to bf16 where `round_weights` (the block's
 * cast to the activations' dtype). row: X elements of scratch. Returns 0, or 7 where a probability
 * is NaN or torch_top_k declines. */
static __attribute__((optimize("no-fast-math"))) int route_token(
        const void *logits, int64_t X, int64_t top_k, int renormalize, int round_weights, int dtype,
        float *probs, ranked *row, int64_t *ids, float *weights) {
    for (int64_t i = 0; i < X; i++) probs[i] = bits_value(value_bits(logits, i, dtype));
    vec_softmax(probs, X);
    for (int64_t i = 0; i < X; i++) {
        if (is_nan_bits(value_bits(probs, i, DTYPE_F32))) return 7;
        row[i] = (ranked){.value = probs[i], .index = i};
    }
    if (torch_top_k(row, X, top_k) != 0) return 7;
    for (int64_t j = 0; j < top_k; j++) {
        ids[j] = row[j].index;
        weights[j] = row[j].value;
    }
    if (renormalize) {
        float sum = weights[0];
        for (int64_t j = 1; j < top_k; j++) sum = sum + weights[j];
        for (int64_t j = 0; j < top_k; j++) weights[j] = weights[j] / sum;
    }
    for (int64_t j = 0; round_weights && j < top_k; j++) weights[j] = bf16_to_f32(f32_to_bf16(weights[j]));
    return 0;
}

/* 1 / (1 + exp(-a)), the exp Vectorized's (vec_expf) or the C library's: out of line, so that no
 * loop around it is vectorised with another expf. */
static __attribute__((noinline, optimize("no-fast-math"))) float sigmoid_value(float a, int vector_exp) {
    return 1.0f / (1.0f + (vector_exp ? vec_expf(-a) : expf(-a)));
}

/* torch.sigmoid of n values in place (the shared expert's gate), as PyTorch's CPU kernel computes
 * it: in fp32, whole pairs of vectors (32 fp32 or 64 bf16 values) with Vectorized's exp, the rest
 * one by one with the C library's. */
static void torch_sigmoid(void *x, int64_t n, int dtype) {
    const int64_t pair = dtype == DTYPE_F32 ? 32 : 64, vectorised = n - n % pair;
    for (int64_t i = 0; i < n; i++) {
        const float y = sigmoid_value(bits_value(value_bits(x, i, dtype)), i < vectorised);
        if (dtype == DTYPE_F32)
            ((float *)x)[i] = y;
        else
            ((uint16_t *)x)[i] = f32_to_bf16(y);
    }
}

/*
 * A whole decode step of the decoder layers (one new token per sequence) in one call: the CPU's
 * counterpart of replaying a captured CUDA graph. At batch 1 a step is ~50 memory-bound
 * matrix-vector products of a few megabytes each; issued one by one from Python, the dispatch
 * between them costs a third of the step, and at batch 64 the ~180 ops of a step still cost a few
 * milliseconds of dispatch. Here the layer loop runs inside one OpenMP parallel region: the
 * products (the matrix-vector kernel below min_panel_rows sequences, the panel kernel from there;
 * without panel copies, the matrix-vector kernel for up to MAX_GEMV_ROWS)
 * and the attention are shared among the threads, the per-row work (norms, rotary, cache
 * writes, activation) is split by rows, and the threads meet at barriers instead of forking and
 * joining for every op.
 *
 * The arithmetic is that of the per-op kernels above, through the same compiled functions
 * (the row helpers are noinline so that no caller gets a differently vectorised copy), so the
 * result equals the module-by-module path bit for bit.
 *
 * token_ids (num_seqs,), each in [0, vocab_size), are looked up in the model's embedding into
 * hidden (num_seqs, hidden_size), which then holds the residual stream and ends as the last
 * layer's output; out (num_seqs, hidden_size) receives it through the final norm and, unless
 * logits is NULL, logits (num_seqs, vocab_size) the lm_head's product of out. The lookup, the
 * final norm, the rotary angles and the lm_head are in the call because, between steps of
 * streaming the weights, the caches hold none of Python's and PyTorch's working set: there the
 * small ops around the layers took ~0.5 ms of a ~5 ms bf16 batch-1 step, against tens of
 * microseconds warm. positions (num_seqs,) index the model's rotary tables, each in
 * [0, rope_positions); slots (num_seqs,); block_tables (num_seqs, max_blocks); seq_lens
 * (num_seqs,), the new token included. workspace: decode_workspace_bytes(). More than
 * MAX_GEMV_ROWS sequences need the panels of every layer and of the lm_head (and
 * has_panel_gemm(dtype)). Returns 0, 1 if scratch memory could not be allocated, 2 for a bad shape,
 * 3 for a token id outside the vocabulary, 4 for a position outside the rotary tables (both
 * checked before any work), 7 where a mixture-of-experts layer declined the step
 * (moe_block_tasks): that layer and the ones before it have written their keys and values (its
 * attention runs before its block), as the module path that must then run the step writes them.
 *
 * A layer with a `moe` block runs it (moe_block_tasks) in place of the gate/up and down products;
 * its output is added into the residual stream in the pass of the next norm, as the optimised
 * model's decoder adds it (add_rms_norm).
 */
/* A mixture-of-experts layer's block (SparseMoeBlock): the router's linear, the routed experts as
 * moe_experts reads them and, for Qwen2-MoE, the shared expert and its sigmoid gate (NULL where the
 * model has none). renormalize: norm_topk_prob (or Mixtral's); round_weights: the routing
 * weights cast to bf16 (Qwen's blocks in bf16). */
typedef struct {
    const void *router_weight, *router_bias, *router_panels;                    /* (num_experts, E) */
    const moe_expert *experts;                                                  /* num_experts */
    const void *shared_gate_up_weight, *shared_gate_up_bias, *shared_gate_up_panels;  /* (2 Fs, E) */
    const void *shared_down_weight, *shared_down_bias, *shared_down_panels;     /* (E, Fs) */
    const void *shared_gate_weight, *shared_gate_bias, *shared_gate_panels;     /* (1, E) */
    int64_t max_panel_rows;  /* as for moe_experts */
    int32_t renormalize, round_weights;
} decode_moe;

typedef struct {
    const void *input_norm, *qkv_weight, *qkv_bias, *q_norm, *k_norm, *o_weight, *o_bias;
    const void *post_norm, *gate_up_weight, *gate_up_bias, *down_weight, *down_bias;
    void *k_cache, *v_cache;  /* (num_blocks, block_size, num_kv_heads, head_dim) */
    const void *qkv_panels, *o_panels, *gate_up_panels, *down_panels;  /* pack_panels() copies */
    const decode_moe *moe;  /* a mixture-of-experts layer's block, in place of the gate/up and down */
    /* Per-channel scales of weight-only int8 linears (ops/quant.py), whose panels are then int8
     * (pack_int8_panels) and which have no row-major copy; NULL for the dtype's weights. */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
} decode_layer;  /* bias, q/k norm, panel and scale pointers are NULL where the model has none */

typedef struct {
    int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t block_size, window, vocab_size;
    int64_t rotary_dim;  /* the leading dimensions of each head the rotary embedding turns */
    /* the mixture-of-experts layers' shape: 0 experts for a dense model, 0 Fs without shared experts */
    int64_t num_experts, top_k, moe_intermediate_size, shared_intermediate_size;
    float eps, scale;
    int dtype;
    int kv_dtype;  /* the cache's: 0 for the activations' dtype, or an fp8 KV_DTYPE_* (stored as by write_kv) */
} decode_shape;

typedef struct {
    const void *embedding;                          /* (vocab_size, hidden_size) */
    const void *final_norm;                         /* (hidden_size,) */
    const void *lm_head_weight, *lm_head_bias;      /* (vocab_size, hidden_size) row-major, bias or NULL */
    const void *lm_head_panels;                     /* pack_panels() copy, or NULL */
    const void *rope_cos, *rope_sin;                /* (rope_positions, rotary_dim), in the dtype */
    int64_t rope_positions;
} decode_model;

static int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* The mixture-of-experts layers' buffers in decode_layers' workspace, after the dense layers': per
 * token its expert ids, probabilities and weights, moe_experts' scratch, its router logits and,
 * with a shared expert, its gate, gate/up product, activation and output. */
typedef struct {
    int64_t *ids;
    float *probs, *weights;
    ranked *ranks;  /* route_token's row, one token at a time */
    moe_scratch scratch;
    char *logits, *gate, *shared_gate_up, *shared_act, *shared_out;
} moe_buffers;

static int64_t dense_workspace_bytes(const decode_shape *shape, int64_t num_seqs) {
    const int64_t q_size = shape->num_heads * shape->head_dim;
    const int64_t qkv_size = q_size + 2 * shape->num_kv_heads * shape->head_dim;
    const int64_t per_row = 2 * shape->hidden_size + qkv_size + 2 * q_size + 3 * shape->intermediate_size;
    return align64(num_seqs * per_row * (shape->dtype == DTYPE_F32 ? 4 : 2));
}

/* Lays the buffers out from base (NULL: only counts); returns their bytes. */
static int64_t moe_buffers_at(char *base, const decode_shape *shape, int64_t M, moe_buffers *b) {
    const int64_t X = shape->num_experts, k = shape->top_k, E = shape->hidden_size;
    const int64_t Fs = shape->shared_intermediate_size, elem = shape->dtype == DTYPE_F32 ? 4 : 2;
    if (X == 0) return 0;
    const int64_t sizes[] = {
        M * k * 8, M * X * 4, M * k * 4, moe_scratch_bytes(M * k, X, E, shape->moe_intermediate_size, elem),
        M * X * elem, M * elem, M * 2 * Fs * elem, M * Fs * elem, M * E * elem, X * (int64_t)sizeof(ranked),
    };
    char *parts[10];
    int64_t offset = 0;
    for (int i = 0; i < 10; i++) {
        parts[i] = base == NULL ? NULL : base + offset;
        offset += align64(sizes[i]);
    }
    if (base != NULL) {
        *b = (moe_buffers){
            .ids = (int64_t *)parts[0], .probs = (float *)parts[1], .weights = (float *)parts[2],
            .scratch = moe_scratch_at(parts[3], M * k, X, E, shape->moe_intermediate_size, elem),
            .logits = parts[4], .gate = parts[5], .shared_gate_up = parts[6], .shared_act = parts[7],
            .shared_out = parts[8], .ranks = (ranked *)parts[9],
        };
    }
    return offset;
}

int64_t decode_workspace_bytes(const decode_shape *shape, int64_t num_seqs) {
    return dense_workspace_bytes(shape, num_seqs) + moe_buffers_at(NULL, shape, num_seqs, NULL);
}

/* y = x W^T + b, shared among the threads of the enclosing parallel region, which all return with y
 * complete: the matrix-vector kernel (takes_gemv) or the panel kernel; with `scale`, the int8
 * panel kernel over int8 panels (int8_panel_tasks), for every M as PackedInt8Linear. */
static void decode_linear(task_team *team, const void *rows, const void *panels, const float *scale,
                          const void *bias, const void *x, void *y, int64_t M, int64_t N, int64_t K,
                          int dtype) {
    if (scale != NULL) {
#if defined(HAS_PANEL_KERNEL)
        int8_panel_tasks(team, x, panels, scale, bias, y, M, N, K, dtype);
#endif
#pragma omp barrier
        return;
    }
    if (takes_gemv(panels, M, dtype)) {
        gemv_rows(team, rows, x, bias, NULL, y, M, N, K, dtype);
        return;
    }
    panel_tasks(team, x, panels, bias, y, M, N, K, dtype);
#pragma omp barrier
}

/* residual += x W^T + b, the product rounded to the dtype before the sum as `h + linear(x)` rounds
 * in PyTorch, then normed = the RMSNorm (weight `norm`) of each new residual row: the residual
 * stream's update and the norm that reads it (vLLM's fused_add_rms_norm). The matrix-vector kernel
 * adds the product as it goes; the panel kernel's product (into `product`, M x N) is added in the
 * norm's pass over each row (add_rms_norm's arithmetic), one pass over the rows and one barrier
 * fewer than a sum of its own. */
static void decode_linear_add_norm(task_team *team, const void *rows, const void *panels, const float *scale,
                                   const void *bias, const void *x, void *residual, void *product,
                                   const void *norm, void *normed, int64_t M, int64_t N, int64_t K, float eps,
                                   int dtype) {
    const int64_t row_bytes = N * (dtype == DTYPE_F32 ? 4 : 2);
    const int sum_in_norm = scale != NULL || !takes_gemv(panels, M, dtype);
    if (sum_in_norm)
        decode_linear(team, rows, panels, scale, bias, x, product, M, N, K, dtype);
    else
        gemv_rows(team, rows, x, bias, residual, residual, M, N, K, dtype);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const char *sum = sum_in_norm ? (const char *)product + m * row_bytes : NULL;
        add_rms_norm_row((char *)residual + m * row_bytes, sum, norm, (char *)normed + m * row_bytes, N, eps,
                         dtype);
    }
}

/* Whether a layer's MLP or mixture-of-experts block has the panel copies that more than
 * MAX_GEMV_ROWS rows need (the experts' are moe_experts' to check). */
static int mlp_has_panels(const decode_layer *layer) {
    const decode_moe *moe = layer->moe;
    if (moe == NULL) return layer->gate_up_panels != NULL && layer->down_panels != NULL;
    const int shared = moe->shared_gate_up_weight != NULL || moe->shared_gate_up_panels != NULL;
    return moe->router_panels != NULL && (!shared || (moe->shared_gate_up_panels != NULL &&
                                                      moe->shared_down_panels != NULL &&
                                                      moe->shared_gate_panels != NULL));
}

/* A mixture-of-experts block for the M rows of x into out (M x E), shared among the threads of the
 * enclosing parallel region, which all return with out complete, as SparseMoeBlock.forward computes
 * it on the optimised model: the router's product (the kernel its PackedLinear picks), the routing
 * (route_token), the routed experts through moe_expert_tasks (KernelMoeExperts' call) summed from
 * zeros, then out + sigmoid(shared gate) * shared expert, each op rounded to the dtype. Where
 * route_token declines a token (a NaN probability, or torch.topk's rare heap-select path) or an
 * expert's rows do not fit its copies, *declined becomes 7 for every thread and out holds zeros.
 * The heap-select path is not known to be reached by any test: none of the routings fuzzed for it
 * hit it. */
static void moe_block_tasks(task_team *team, const decode_moe *moe, const decode_shape *shape, const void *x,
                            void *out, int64_t M, const moe_buffers *b, int *declined) {
    const int64_t E = shape->hidden_size, X = shape->num_experts, k = shape->top_k;
    const int64_t Fs = shape->shared_intermediate_size;
    const int dtype = shape->dtype;
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    const moe_scratch *s = &b->scratch;
    decode_linear(team, moe->router_weight, moe->router_panels, NULL, moe->router_bias, x, b->logits, M, X,
                  E, dtype);
#pragma omp single
    {
        int status = 0;
        for (int64_t m = 0; m < M && status == 0; m++)
            status = route_token(b->logits + m * X * elem, X, k, moe->renormalize, moe->round_weights, dtype,
                                 b->probs + m * X, b->ranks, b->ids + m * k, b->weights + m * k);
        if (status == 0) status = sort_pairs(b->ids, M * k, X, s->order, s->position, s->first, s->cursor);
        if (status == 0) status = check_experts(moe->experts, s->first, X, moe->max_panel_rows, dtype);
        if (status != 0) *declined = 7;
        memset(out, 0, M * E * elem);
    }
    if (*declined) return;
    moe_expert_tasks(team, moe->experts, X, x, b->weights, DTYPE_F32, out, M, k, E,
                     shape->moe_intermediate_size, dtype, s);
    if (Fs == 0) return;
    decode_linear(team, moe->shared_gate_weight, moe->shared_gate_panels, NULL, moe->shared_gate_bias, x,
                  b->gate, M, 1, E, dtype);
    decode_linear(team, moe->shared_gate_up_weight, moe->shared_gate_up_panels, NULL,
                  moe->shared_gate_up_bias, x, b->shared_gate_up, M, 2 * Fs, E, dtype);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        silu_and_mul_row(b->shared_gate_up + m * 2 * Fs * elem, b->shared_act + m * Fs * elem, Fs, dtype);
    decode_linear(team, moe->shared_down_weight, moe->shared_down_panels, NULL, moe->shared_down_bias,
                  b->shared_act, b->shared_out, M, E, Fs, dtype);
#pragma omp single
    torch_sigmoid(b->gate, M, dtype);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        scale_row(b->shared_out + m * E * elem, bits_value(value_bits(b->gate, m, dtype)), E, dtype);
        add_row((char *)out + m * E * elem, b->shared_out + m * E * elem, E, dtype);
    }
}

int decode_layers(const decode_layer *layers, const decode_shape *shape, const decode_model *model,
                  const int64_t *token_ids, const int64_t *positions, const int64_t *slots,
                  const int64_t *block_tables, const int64_t *seq_lens, int64_t num_seqs, int64_t max_blocks,
                  void *hidden, void *out, void *logits, void *workspace, int num_threads) {
    const int64_t E = shape->hidden_size, H = shape->num_heads, KV = shape->num_kv_heads;
    const int64_t D = shape->head_dim, F = shape->intermediate_size, V = shape->vocab_size, M = num_seqs;
    const int64_t R = shape->rotary_dim;
    const int dtype = shape->dtype, cache_dtype = dtype | shape->kv_dtype << 4;
    if (KV <= 0 || H % KV != 0 || M < 1 || R < 2 || R > D || R % 2 != 0) return 2;
    if (shape->kv_dtype < 0 || shape->kv_dtype > 15 || !valid_cache_dtype(cache_dtype)) return 2;
    for (int64_t l = 0; l < shape->num_layers; l++)  /* a routed layer needs experts to route to */
        if (layers[l].moe != NULL &&
            (shape->num_experts < 1 || shape->top_k < 1 || shape->top_k > shape->num_experts))
            return 2;
    for (int64_t m = 0; m < M; m++)
        if (token_ids[m] < 0 || token_ids[m] >= V) return 3;
    for (int64_t m = 0; m < M; m++)
        if (positions[m] < 0 || positions[m] >= model->rope_positions) return 4;
    if (M > MAX_GEMV_ROWS) {
        if (!has_panel_gemm(dtype) || (logits != NULL && model->lm_head_panels == NULL)) return 2;
        for (int64_t l = 0; l < shape->num_layers; l++)
            if (layers[l].qkv_panels == NULL || layers[l].o_panels == NULL || !mlp_has_panels(&layers[l]))
                return 2;
    }
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    const int64_t q_size = H * D, kv_size = KV * D, qkv_size = q_size + 2 * kv_size;
    const int64_t kv_row_bytes = kv_size * kv_elem_size(cache_dtype);
    char *normed = workspace;                 /* (M, E) */
    char *qkv = normed + M * E * elem;        /* (M, q_size + 2 kv_size) */
    char *q = qkv + M * qkv_size * elem;      /* (M, H, D): rotated queries, as attention reads them */
    char *attn = q + M * q_size * elem;       /* (M, H, D) */
    char *gate_up = attn + M * q_size * elem; /* (M, 2F) */
    char *act = gate_up + M * 2 * F * elem;   /* (M, F) */
    char *product = act + M * F * elem;       /* (M, E): o and down products before the residual */
    moe_buffers moe_bufs;
    moe_buffers_at((char *)workspace + dense_workspace_bytes(shape, M), shape, M, &moe_bufs);
    char *x = hidden;
    const int64_t scratch_floats = attention_scratch_floats(max_seq_len(seq_lens, M), H, D);
    decode_split split;
    if (plan_decode_split(seq_lens, M, shape->window, H, D, num_threads, &split) != 0) return 1;
    int failed = 0, declined = 0;
    task_share shares[num_threads];
    clear_shares(shares, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = thread_scratch(scratch_floats, &failed);
        task_team team = team_of(shares);
        /* Each norm shares its pass over the rows with what last wrote the residual stream: the
         * embedding lookup for the first layer's input norm (the final norm's, without layers),
         * decode_linear_add_norm for the others. */
        const void *first_norm = shape->num_layers > 0 ? layers[0].input_norm : model->final_norm;
        char *first_normed = shape->num_layers > 0 ? normed : out;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            memcpy(x + m * E * elem, (const char *)model->embedding + token_ids[m] * E * elem, E * elem);
            rms_norm_row(x + m * E * elem, first_norm, first_normed + m * E * elem, E, shape->eps, dtype);
        }
        for (int64_t l = 0; l < shape->num_layers; l++) {
            const decode_layer *layer = &layers[l];
            decode_linear(&team, layer->qkv_weight, layer->qkv_panels, layer->qkv_scale, layer->qkv_bias,
                          normed, qkv, M, qkv_size, E, dtype);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                char *q_row = qkv + m * qkv_size * elem, *k_row = q_row + q_size * elem;
                const char *v_row = k_row + kv_size * elem;
                const char *cos_row = (const char *)model->rope_cos + positions[m] * R * elem;
                const char *sin_row = (const char *)model->rope_sin + positions[m] * R * elem;
                for (int64_t h = 0; layer->q_norm != NULL && h < H; h++)
                    rms_norm_row(q_row + h * D * elem, layer->q_norm, q_row + h * D * elem, D, shape->eps,
                                 dtype);
                for (int64_t h = 0; layer->k_norm != NULL && h < KV; h++)
                    rms_norm_row(k_row + h * D * elem, layer->k_norm, k_row + h * D * elem, D, shape->eps,
                                 dtype);
                rotary_token(q_row, cos_row, sin_row, H, D, R, dtype);
                rotary_token(k_row, cos_row, sin_row, KV, D, R, dtype);
                memcpy(q + m * q_size * elem, q_row, q_size * elem);
                store_cache_row((char *)layer->k_cache + slots[m] * kv_row_bytes, k_row, kv_size,
                                cache_dtype);
                store_cache_row((char *)layer->v_cache + slots[m] * kv_row_bytes, v_row, kv_size,
                                cache_dtype);
            }
            attention_tasks(&team, q, layer->k_cache, layer->v_cache, attn, block_tables, seq_lens, M,
                            max_blocks, H, KV, D, shape->block_size, shape->window, shape->scale,
                            0.0f /* no soft cap: decode_graph declines such models */, cache_dtype,
                            num_threads, scratch, &split);
            decode_linear_add_norm(&team, layer->o_weight, layer->o_panels, layer->o_scale, layer->o_bias, attn,
                                   x, product, layer->post_norm, normed, M, E, q_size, shape->eps, dtype);
            const int last = l + 1 == shape->num_layers;
            const void *next_norm = last ? model->final_norm : layers[l + 1].input_norm;
            char *next_normed = last ? out : normed;
            if (layer->moe != NULL) {
                moe_block_tasks(&team, layer->moe, shape, normed, product, M, &moe_bufs, &declined);
                if (declined) break;
#pragma omp for schedule(static)
                for (int64_t m = 0; m < M; m++)
                    add_rms_norm_row(x + m * E * elem, product + m * E * elem, next_norm,
                                     next_normed + m * E * elem, E, shape->eps, dtype);
                continue;
            }
            decode_linear(&team, layer->gate_up_weight, layer->gate_up_panels, layer->gate_up_scale,
                          layer->gate_up_bias, normed, gate_up, M, 2 * F, E, dtype);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                silu_and_mul_row(gate_up + m * 2 * F * elem, act + m * F * elem, F, dtype);
            decode_linear_add_norm(&team, layer->down_weight, layer->down_panels, layer->down_scale,
                                   layer->down_bias, act, x, product, next_norm, next_normed, M, E, F,
                                   shape->eps, dtype);
        }
        if (logits != NULL && !declined)
            decode_linear(&team, model->lm_head_weight, model->lm_head_panels, NULL, model->lm_head_bias,
                          out, logits, M, V, E, dtype);
        free(scratch);
    }
    free_decode_split(&split);
    return failed ? failed : declined;
}

/*
 * num_steps greedy decode steps in one call, each a decode_layers() step whose tokens are the
 * previous step's argmax (argmax_rows, torch.argmax's choice): the CPU counterpart of vLLM v0's
 * multi-step scheduling. At batch 1 a step's return to Python costs ~0.5 ms of a ~4.6 ms bf16
 * step, as the weights' stream has evicted the interpreter's working set; here it is paid once per
 * num_steps tokens.
 *
 * token_ids (num_seqs,) are the first step's tokens at positions (num_seqs,); step s feeds each
 * sequence its token at position positions[m] + s, whose slot comes from block_tables (num_seqs,
 * max_blocks), which must cover positions[m] + num_steps - 1. sampled (num_steps, num_seqs)
 * receives every step's argmax; hidden, out, logits and workspace as for decode_layers, holding
 * the last step's. The caller's arrays are not modified. Returns decode_layers' statuses, or 5 for
 * a position the block tables do not cover (checked before any work); *steps_done receives the
 * number of steps whose tokens sampled holds (those before a step that returned 7).
 */
int decode_greedy(const decode_layer *layers, const decode_shape *shape, const decode_model *model,
                  const int64_t *token_ids, const int64_t *positions, const int64_t *block_tables,
                  int64_t num_seqs, int64_t max_blocks, int64_t num_steps, void *hidden, void *out,
                  void *logits, int64_t *sampled, int64_t *steps_done, void *workspace, int num_threads) {
    const int64_t M = num_seqs, S = shape->block_size;
    if (M < 1 || num_steps < 1 || S < 1) return 2;
    for (int64_t m = 0; m < M; m++)
        if (positions[m] < 0 || (positions[m] + num_steps - 1) / S >= max_blocks) return 5;
    int64_t *state = malloc(4 * M * sizeof(int64_t));
    if (state == NULL) return 1;
    int64_t *tokens = state, *pos = state + M, *slots = state + 2 * M, *lens = state + 3 * M;
    memcpy(tokens, token_ids, M * sizeof(int64_t));
    memcpy(pos, positions, M * sizeof(int64_t));
    int status = 0;
    *steps_done = 0;
    for (int64_t s = 0; s < num_steps && status == 0; s++) {
        for (int64_t m = 0; m < M; m++) {
            slots[m] = block_tables[m * max_blocks + pos[m] / S] * S + pos[m] % S;
            lens[m] = pos[m] + 1;
        }
        status = decode_layers(layers, shape, model, tokens, pos, slots, block_tables, lens, M, max_blocks,
                               hidden, out, logits, workspace, num_threads);
        if (status != 0) break;
        argmax_rows(logits, sampled + s * M, M, shape->vocab_size, shape->dtype, num_threads);
        for (int64_t m = 0; m < M; m++) {
            tokens[m] = sampled[s * M + m];
            pos[m]++;
        }
        *steps_done = s + 1;
    }
    free(state);
    return status;
}
