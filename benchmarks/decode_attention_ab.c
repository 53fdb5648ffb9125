/*
 * Two builds of the decode attention kernel, alternating call by call, with the keys and values
 * coming from memory as they do in a decode step.
 *
 * benchmarks/decode_attention.py times the kernel against PyTorch; this compares two versions of
 * the kernel itself (before and after a change), which on a shared machine only alternating in
 * one process can do. The caches of 12 layers (shuffled blocks of 16 tokens, by default the bench
 * model's 12 query / 4 kv heads of 64) are called layer after layer; with --cold a 96 MiB buffer is read
 * on both threads before each call (not timed), so that even one short sequence's rows, whose 12
 * layers fit in the last-level cache, come from memory, and the kernel's OpenMP threads are
 * awake when the call starts (a read through PyTorch would leave them asleep: its OpenMP runtime
 * is another copy). Prints the median milliseconds per call of each build and the median over
 * the rounds of their ratio, then a JSON line.
 *
 *     gcc -O3 -march=native -ffast-math -fopenmp -fPIC -std=c11 -shared \
 *         -o old.so old/attention.c old/cpu_ops.c -lm          (and new.so from the new sources)
 *     gcc -O2 -fopenmp -o decode_attention_ab benchmarks/decode_attention_ab.c -ldl
 *     ./decode_attention_ab old.so new.so SEQS KEYS [bf16] [--cold] [--uneven] [--heads H/K/D]
 *                           [--softcap CAP] [--threads N]
 *
 * KEYS per sequence, or with --uneven lengths drawn from [KEYS / 4, KEYS). fp32 unless bf16.
 * --heads sets the layout (H query heads, K kv heads of D; Gemma's: 8/4/256 or 8/1/256). No soft
 * cap (0.0f) unless --softcap. A build from before the soft cap was added takes the same call: its
 * scale and the cap travel in vector registers, the integers where they always did, so it ignores
 * it (compare such a build only without --softcap). No sinks: the last argument is NULL, which a
 * build from before sinks were added takes too (the pointer comes after its last argument on the
 * stack, which it never reads). Two threads unless --threads (one where another process keeps a
 * core busy: a team waiting on a descheduled thread measures the scheduler).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*attention_fn)(const void *, const void *, const void *, void *, const int64_t *,
                            const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, float, float, int, int, const float *);

enum { LAYERS = 12, BLOCK = 16, ROUNDS = 31 };
static const int64_t EVICT_BYTES = 96 << 20;

static int compare(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *values, int n) {
    qsort(values, n, sizeof(double), compare);
    return values[n / 2];
}

static attention_fn load(const char *path) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    attention_fn fn = handle ? (attention_fn)dlsym(handle, "paged_decode_attention") : NULL;
    if (fn == NULL) {
        fprintf(stderr, "%s: no paged_decode_attention (%s)\n", path, dlerror());
        exit(1);
    }
    return fn;
}

/* Values of the order of 1 in either dtype: fp32 bits, or bf16 halves of them. */
static void fill(void *buffer, int64_t bytes) {
    for (int64_t i = 0; i < bytes / 2; i++) ((uint16_t *)buffer)[i] = 0x3c00 + rand() % 512;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s OLD.so NEW.so SEQS KEYS [bf16] [--cold] [--uneven] [--heads H/K/D] "
                "[--softcap CAP] [--threads N]\n", argv[0]);
        return 2;
    }
    int bf16 = 0, cold = 0, uneven = 0;
    long heads = 12, kv_heads = 4, head_dim = 64;  /* the bench model's */
    float softcap = 0.0f;
    int threads = 2;
    for (int i = 5; i < argc; i++) {
        bf16 |= strcmp(argv[i], "bf16") == 0;
        cold |= strcmp(argv[i], "--cold") == 0;
        uneven |= strcmp(argv[i], "--uneven") == 0;
        if (strcmp(argv[i], "--heads") == 0 && i + 1 < argc &&
            (sscanf(argv[++i], "%ld/%ld/%ld", &heads, &kv_heads, &head_dim) != 3 || kv_heads <= 0 ||
             heads % kv_heads != 0 || head_dim <= 0)) {
            fprintf(stderr, "--heads %s: want H/K/D with K dividing H\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--softcap") == 0 && i + 1 < argc) softcap = (float)atof(argv[++i]);
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc && (threads = atoi(argv[++i])) < 1) {
            fprintf(stderr, "--threads %s: want at least 1\n", argv[i]);
            return 2;
        }
    }
    const attention_fn builds[2] = {load(argv[1]), load(argv[2])};
    const int64_t seqs = atoll(argv[3]), keys = atoll(argv[4]), elem = bf16 ? 2 : 4;
    const int64_t blocks_per_seq = (keys + BLOCK - 1) / BLOCK, blocks = seqs * blocks_per_seq;
    const int64_t cache_bytes = blocks * BLOCK * kv_heads * head_dim * elem;
    const int64_t q_bytes = seqs * heads * head_dim * elem;
    srand(5);
    char *k[LAYERS], *v[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        k[l] = malloc(cache_bytes), v[l] = malloc(cache_bytes);
        fill(k[l], cache_bytes), fill(v[l], cache_bytes);
    }
    char *q = malloc(q_bytes), *out[2] = {malloc(q_bytes), malloc(q_bytes)};
    fill(q, q_bytes);
    int64_t *tables = malloc(blocks * sizeof(int64_t)), *lens = malloc(seqs * sizeof(int64_t));
    for (int64_t i = 0; i < blocks; i++) tables[i] = (i * 7919) % blocks;  /* shuffled blocks */
    double kv_bytes = 0;
    for (int64_t s = 0; s < seqs; s++) {
        lens[s] = uneven ? keys / 4 + rand() % (keys - keys / 4) : keys;
        kv_bytes += 2.0 * lens[s] * kv_heads * head_dim * elem;
    }
    char *evict = malloc(EVICT_BYTES);
    memset(evict, 1, EVICT_BYTES);
    volatile long sink = 0;
    double ms[2][ROUNDS], ratio[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        for (int b = 0; b < 2; b++) {
            double seconds = 0;
            for (int l = 0; l < LAYERS; l++) {
                if (cold) {
                    long sum = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sum)
                    for (int64_t i = 0; i < EVICT_BYTES; i += 64) sum += evict[i];
                    sink += sum;
                }
                const double start = omp_get_wtime();
                const int status = builds[b](q, k[l], v[l], out[b], tables, lens, seqs, blocks_per_seq, heads,
                                             kv_heads, head_dim, BLOCK, 0, 0.125f, softcap, bf16, threads,
                                             NULL);
                seconds += omp_get_wtime() - start;
                if (status != 0) {
                    fprintf(stderr, "build %d failed with status %d\n", b, status);
                    return 1;
                }
            }
            ms[b][r] = 1e3 * seconds / LAYERS;
        }
        ratio[r] = ms[0][r] / ms[1][r];
    }
    const double old_ms = median(ms[0], ROUNDS), new_ms = median(ms[1], ROUNDS);
    const double ratio_median = median(ratio, ROUNDS);  /* sorts ratio */
    const double quartile_lo = ratio[ROUNDS / 4], quartile_hi = ratio[3 * ROUNDS / 4];
    printf("%ld/%ld heads of %ld, cap %g, %d threads: ", heads, kv_heads, head_dim, softcap, threads);
    printf("%ld x %s%ld %s keys%s: old %.3f ms, new %.3f ms per call (%.1f / %.1f GB/s of keys and "
           "values); old/new per round %.3f [%.3f, %.3f]\n",
           (long)seqs, uneven ? "up to " : "", (long)keys, bf16 ? "bf16" : "fp32", cold ? ", cold" : "",
           old_ms, new_ms, kv_bytes / old_ms / 1e6, kv_bytes / new_ms / 1e6, ratio_median, quartile_lo,
           quartile_hi);
    printf("{\"benchmark\": \"decode_attention_ab\", \"heads\": %ld, \"kv_heads\": %ld, \"head_dim\": %ld, "
           "\"softcap\": %g, \"seqs\": %ld, \"keys\": %ld, \"dtype\": \"%s\", "
           "\"cold\": %s, \"uneven\": %s, \"old_ms\": %.4f, \"new_ms\": %.4f, \"old_over_new\": %.4f}\n",
           heads, kv_heads, head_dim, softcap, (long)seqs, (long)keys, bf16 ? "bfloat16" : "float32",
           cold ? "true" : "false", uneven ? "true" : "false", old_ms, new_ms, ratio_median);
    return 0;
}
