/* kvtier fused per-layer ops for fp32 activations: one call instead of 3-6 small torch ops each.
 *
 *   kv_rmsnorm:  out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps))         (HF's RMSNorm, fp32)
 *   kv_rope:     rotate interleaved pairs of the Q|K part of the fused QKV output in place,
 *                (a + ib) * (c + is) with (c, s) = table[pos[t], j]       (no FMA: torch's rounding)
 *   kv_rope_store: kv_rope, then the new K|V rows copied to their slots of a float32 KV pool
 *   kv_silu_mul: out[t] = silu(gu[t, :I]) * gu[t, I:]                    (SwiGLU's gate * up)
 *
 * Elementwise results round like torch's ops except two: RMSNorm's sum of squares is summed in a
 * different order, and exp() inside silu is a polynomial (~1 ulp): both stay far inside the 1e-4
 * logits tolerance the model's parity tests hold (tests/test_model_parity.py). AVX2 + FMA; raw
 * pointers through ctypes (no torch headers). Built by kvtier/models/qkernels.py like qmatmul.c.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x, out: [T, H] row-major (row stride ldx / ldo floats); w: [H]. out may alias x. */
void kv_rmsnorm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t T,
                int64_t H, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *orow = out + t * ldo;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= H; j += 16) {
            __m256 v0 = _mm256_loadu_ps(xr + j), v1 = _mm256_loadu_ps(xr + j + 8);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
        }
        float ss = hsum8(_mm256_add_ps(a0, a1));
        for (; j < H; j++) ss += xr[j] * xr[j];
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        __m256 rv = _mm256_set1_ps(r);
        for (j = 0; j + 8 <= H; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + j), rv);
            _mm256_storeu_ps(orow + j, _mm256_mul_ps(v, _mm256_loadu_ps(w + j)));
        }
        for (; j < H; j++) orow[j] = (xr[j] * r) * w[j];
    }
}

/* qk: [T, ld] with the first n_heads * D floats of each row rotated; table: [P, D/2, 2] (cos, sin);
 * pos: [T] int64. Pairs (2i, 2i+1) of each head are one complex number. */
void kv_rope(float *qk, int64_t ld, const float *table, const int64_t *pos, int64_t T,
             int64_t n_heads, int64_t D) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *f = table + pos[t] * D;
        float *row = qk + t * ld;
        for (int64_t h = 0; h < n_heads; h++) {
            float *v = row + h * D;
            int64_t i = 0;
            for (; i + 4 <= half; i += 4) { /* 4 complex numbers = 8 floats */
                __m256 a = _mm256_loadu_ps(v + 2 * i), c = _mm256_loadu_ps(f + 2 * i);
                __m256 cr = _mm256_moveldup_ps(c), ci = _mm256_movehdup_ps(c);
                __m256 sw = _mm256_permute_ps(a, 0xB1); /* (b, a) pairs */
                _mm256_storeu_ps(v + 2 * i, _mm256_addsub_ps(_mm256_mul_ps(a, cr), _mm256_mul_ps(sw, ci)));
            }
            for (; i < half; i++) {
                float a = v[2 * i], b = v[2 * i + 1], c = f[2 * i], s = f[2 * i + 1];
                volatile float ac = a * c, bs = b * s, as = a * s, bc = b * c;
                v[2 * i] = ac - bs;
                v[2 * i + 1] = as + bc;
            }
        }
    }
}

/* kv_rope, then the step's cache write of a float32 pool: each token's K|V (the n floats from koff
 * of its row, RoPE applied) copied to its slot, pool + slot[t] bytes (one layer of the pool; a slot's
 * K|V elements are n contiguous floats). Replaces torch's index_put, ~30 us a layer inside a step. */
void kv_rope_store(float *qk, int64_t ld, const float *table, const int64_t *pos, int64_t T,
                   int64_t n_heads, int64_t D, int64_t koff, int64_t n, uint8_t *pool, const int64_t *slot) {
    kv_rope(qk, ld, table, pos, T, n_heads, D);
    for (int64_t t = 0; t < T; t++) memcpy(pool + slot[t], qk + t * ld + koff, n * sizeof(float));
}

/* gu: [T, 2*I] (gate | up), out: [T, I]. */
void kv_silu_mul(const float *gu, float *out, int64_t T, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t j = 0;
        for (; j + 8 <= I; j += 8) {
            __m256 gv = _mm256_loadu_ps(g + j);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) (accumulate: y += ...), few rows: the fp32 decode GEMV over
 * weights stored transposed ([in, out], as the dense model keeps them).
 *
 * The K rows of w are cut into GEMV_PARTS contiguous ranges (a multiple of 4 rows each), and each range
 * into column chunks (only as many as threads beyond one per range need, and at most ACC / M floats
 * wide). A work item (range, chunk) streams the chunk's floats of the range's rows, four rows at a
 * time, into that range's partial sums [M, N] (L1/L2); the partials are then added in range order
 * and y = (y +) bias + sum. OpenMP hands each thread a run of consecutive items, range-major: on two
 * threads each reads one contiguous half of w, the hardware prefetchers' best case (cutting columns
 * instead had both threads read alternate pieces of every row: ~17 against ~23 GB/s over this
 * model's shapes on a 2-core EPYC).
 *
 * A column's result depends on neither the thread count nor M nor the chunking: the ranges are fixed
 * by K alone, each summed in k order, then added in order. Processes that chose different thread
 * counts therefore compute the same bits (the KV they share through the tiers agrees). */
#define ACC 65536 /* floats of partial sums per item (M rows x chunk width): 256 KiB, L2 */
#define GEMV_PARTS 2

static void gemv_item(const float *x, int64_t M, const float *w, int64_t K, int64_t N, int64_t k0,
                      int64_t k1, int64_t c0, int64_t cw, float *part) {
    for (int64_t m = 0; m < M; m++) memset(part + m * N + c0, 0, (size_t)cw * sizeof(float));
    int64_t k = k0, vw = cw & ~(int64_t)7;
    for (; k + 4 <= k1; k += 4) {
        const float *w0 = w + k * N + c0, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K + k;
            __m256 x0 = _mm256_set1_ps(xm[0]), x1 = _mm256_set1_ps(xm[1]);
            __m256 x2 = _mm256_set1_ps(xm[2]), x3 = _mm256_set1_ps(xm[3]);
            float *a = part + m * N + c0;
            for (int64_t j = 0; j < vw; j += 8) {
                __m256 s = _mm256_loadu_ps(a + j);
                s = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w0 + j), s);
                s = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w1 + j), s);
                s = _mm256_fmadd_ps(x2, _mm256_loadu_ps(w2 + j), s);
                s = _mm256_fmadd_ps(x3, _mm256_loadu_ps(w3 + j), s);
                _mm256_storeu_ps(a + j, s);
            }
            for (int64_t j = vw; j < cw; j++) /* same order as the vector lanes: four fmas */
                a[j] = fmaf(xm[3], w3[j], fmaf(xm[2], w2[j], fmaf(xm[1], w1[j], fmaf(xm[0], w0[j], a[j]))));
        }
    }
    for (; k < k1; k++)
        for (int64_t m = 0; m < M; m++) {
            float *a = part + m * N + c0;
            for (int64_t j = 0; j < cw; j++) a[j] = fmaf(x[m * K + k], w[k * N + c0 + j], a[j]);
        }
}

/* the calling thread's partial sums: GEMV_PARTS x [M, N] floats, grown on demand, kept for its next call */
static __thread float *gemv_scratch;
static __thread size_t gemv_scratch_len;

static float *gemv_partials(size_t n) {
    if (n > gemv_scratch_len) {
        float *grown = (float *)realloc(gemv_scratch, n * sizeof(float));
        if (!grown) return NULL;
        gemv_scratch = grown;
        gemv_scratch_len = n;
    }
    return gemv_scratch;
}

/* The same sums, one column at a time without partials (the fmaf chains are the vector lanes' order):
 * only where the partials cannot be allocated. */
static float gemv_column(const float *xm, const float *w, int64_t K, int64_t N, int64_t step, int64_t j) {
    float total = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        int64_t k1 = k0 + step < K ? k0 + step : K, k = k0;
        float a = 0.0f;
        for (; k + 4 <= k1; k += 4)
            a = fmaf(xm[k + 3], w[(k + 3) * N + j],
                     fmaf(xm[k + 2], w[(k + 2) * N + j], fmaf(xm[k + 1], w[(k + 1) * N + j], fmaf(xm[k], w[k * N + j], a))));
        for (; k < k1; k++) a = fmaf(xm[k], w[k * N + j], a);
        total = k0 == 0 ? a : total + a;
    }
    return total;
}

void kv_sgemv_t(const float *x, int64_t M, const float *w, const float *bias, float *y, int64_t K,
               int64_t N, int accumulate, int threads) {
    if (M <= 0 || N <= 0) return; /* a step that samples nothing has no rows */
    if (threads < 1) threads = 1;
    int64_t step = ((K + GEMV_PARTS - 1) / GEMV_PARTS + 3) & ~(int64_t)3; /* rows per range */
    int64_t parts = K > 0 ? (K + step - 1) / step : 1;
    float *part = gemv_partials((size_t)(parts * M * N));
    if (!part) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) {
                float s = gemv_column(x + m * K, w, K, N, step, j), v = bias ? bias[j] + s : s;
                y[m * N + j] = accumulate ? y[m * N + j] + v : v;
            }
        return;
    }
    if (K <= 0) memset(part, 0, (size_t)(M * N) * sizeof(float));
    int64_t per = (threads + parts - 1) / parts; /* column chunks per range: more threads than ranges */
    int64_t share = ((N + per - 1) / per + 7) & ~(int64_t)7;
    int64_t cols = (N + 63) / 64; /* the sum of the partials, in 64-column pieces */
#pragma omp parallel num_threads(threads) if (threads > 1 && K > 0)
    {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t rows = M - m0 < 4 ? M - m0 : 4;
            int64_t width = share < (ACC / rows & ~(int64_t)7) ? share : ACC / rows & ~(int64_t)7;
            int64_t chunks = (N + width - 1) / width, items = K > 0 ? parts * chunks : 0;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < items; i++) {
                int64_t r = i / chunks, c0 = (i % chunks) * width;
                int64_t k1 = (r + 1) * step < K ? (r + 1) * step : K;
                gemv_item(x + m0 * K, rows, w, K, N, r * step, k1, c0, N - c0 < width ? N - c0 : width,
                          part + r * M * N + m0 * N);
            }
        }
        /* y = (y +) bias + ((p0 + p1) + ...), each thread over its own columns (after the barrier) */
#pragma omp for schedule(static) nowait
        for (int64_t c = 0; c < cols; c++) {
            int64_t j0 = c * 64, j1 = j0 + 64 < N ? j0 + 64 : N;
            for (int64_t m = 0; m < M; m++) {
                float *dst = y + m * N, *s = part + m * N;
                for (int64_t r = 1; r < parts; r++)
                    for (int64_t j = j0; j < j1; j++) s[j] += part[r * M * N + m * N + j];
                for (int64_t j = j0; j < j1; j++) {
                    float v = bias ? bias[j] + s[j] : s[j];
                    dst[j] = accumulate ? dst[j] + v : v;
                }
            }
        }
    }
}
