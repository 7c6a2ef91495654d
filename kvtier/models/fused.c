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
 * weights stored transposed ([in, out], as the dense model keeps them). Each thread owns column
 * chunks (up to ACC / rows floats wide, at least N / threads); for each chunk it streams the K rows of
 * w (the chunk's contiguous floats, four rows at a time) into sums held in L1, then writes
 * y = (y +) bias + sum. A column's sum runs over k in the same order whatever the chunking, so the
 * result does not depend on the thread count. OpenMP over chunks. */
#define ACC 2048
static void gemv_chunk(const float *x, int64_t M, const float *w, const float *bias, float *y,
                       int64_t K, int64_t N, int64_t c0, int64_t cw, int accumulate) {
    float acc[ACC] __attribute__((aligned(32)));
    int64_t ld = (cw + 7) & ~(int64_t)7; /* row stride of acc (8-aligned) */
    for (int64_t j = 0; j < M * ld; j++) acc[j] = 0.0f;
    int64_t k = 0, vw = cw & ~(int64_t)7;
    for (; k + 4 <= K; k += 4) {
        const float *w0 = w + k * N + c0, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K + k;
            __m256 x0 = _mm256_set1_ps(xm[0]), x1 = _mm256_set1_ps(xm[1]);
            __m256 x2 = _mm256_set1_ps(xm[2]), x3 = _mm256_set1_ps(xm[3]);
            float *a = acc + m * ld;
            for (int64_t j = 0; j < vw; j += 8) {
                __m256 s = _mm256_load_ps(a + j);
                s = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w0 + j), s);
                s = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w1 + j), s);
                s = _mm256_fmadd_ps(x2, _mm256_loadu_ps(w2 + j), s);
                s = _mm256_fmadd_ps(x3, _mm256_loadu_ps(w3 + j), s);
                _mm256_store_ps(a + j, s);
            }
            for (int64_t j = vw; j < cw; j++) /* same order as the vector lanes: four fmas */
                a[j] = fmaf(xm[3], w3[j], fmaf(xm[2], w2[j], fmaf(xm[1], w1[j], fmaf(xm[0], w0[j], a[j]))));
        }
    }
    for (; k < K; k++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < cw; j++) acc[m * ld + j] = fmaf(x[m * K + k], w[k * N + c0 + j], acc[m * ld + j]);
    for (int64_t m = 0; m < M; m++) {
        float *dst = y + m * N + c0;
        for (int64_t j = 0; j < cw; j++) {
            float v = bias ? bias[c0 + j] + acc[m * ld + j] : acc[m * ld + j];
            dst[j] = accumulate ? dst[j] + v : v;
        }
    }
}

void kv_sgemv_t(const float *x, int64_t M, const float *w, const float *bias, float *y, int64_t K,
                int64_t N, int accumulate, int threads) {
    if (M <= 0 || N <= 0) return; /* a step that samples nothing has no rows */
    if (threads < 1) threads = 1;
    int64_t rows = M < 4 ? M : 4;
    int64_t width = (ACC / rows) & ~(int64_t)7;
    int64_t share = ((N + threads - 1) / threads + 7) & ~(int64_t)7; /* every thread gets a chunk */
    if (share < width) width = share;
    int64_t chunks = (N + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t c0 = c * width, cw = N - c0 < width ? N - c0 : width;
        for (int64_t m0 = 0; m0 < M; m0 += 4)
            gemv_chunk(x + m0 * K, M - m0 < 4 ? M - m0 : 4, w, bias, y + m0 * N, K, N, c0, cw, accumulate);
    }
}
