/* kvtier decode attention: one query token per sequence over the paged K/V pool, read in place; and
 * the compact write (kv_store_quantized, at the end): a step's new K/V quantized into its slots (or
 * rounded, for a bfloat16 pool).
 *
 * The pool is PagedKVCache.raw (kvtier/models/kv_quant.py). Compact (fp8/int8): uint8 [NB, L,
 * layer_bytes]; one layer row of one block (data_bytes = BS * 2 * KVH * D, one byte per element):
 *
 *     [ data  BS x 2 x KVH x D  (int8 / e4m3 / e5m2) | scales  BS x 2 x KVH  (float32) ]
 *
 * Plain (float32, bfloat16): [NB, L, BS, 2, KVH, D] elements, the same row without scales (each
 * scale is 1) and never rotated; data_bytes = BS * 2 * KVH * D * element size.
 *
 * For each sequence b and KV head h, with its G query heads q_g (one row each) and context length n:
 *
 *     s_g,t = (q_g . k_t) * sk_t * scale              k_t: stored elements of token t, sk_t its scale
 *     p_g,t = exp(s_g,t - max_t s_g,t)
 *     o_g   = sum_t (p_g,t * sv_t) v_t / sum_t p_g,t
 *
 * one pass over K (scores into a scratch row), one over V, no gathered or dequantized copy. The token
 * positions are walked through the block table: token t is row t % BS of block table[t / BS].
 * With a rotation R (the KV dtypes store K and V rotated), q_g is multiplied by R first and o_g by R
 * after (R is symmetric orthonormal: R^-1 = R).
 *
 * Stored elements -> fp32, 8 at a time (the same values torch's conversion gives, exactly):
 *   int8: sign-extend, convert.
 *   e5m2: the byte is the top byte of a float16.
 *   e4m3: sign-extended to int16 and shifted left 7, bits 13..7 are exponent and mantissa of a float16
 *         of value / 2^8 (bias 15 vs 7, subnormals included); bit 14 is set exactly when negative and is
 *         cleared (bit 15 keeps the sign). The 2^8 is folded into the scales. NaN patterns are never
 *         stored (writes clamp to +-448).
 *
 * Work items are (sequence, KV head, part of the context): with several threads a context is split in
 * parts (flash-decoding), each part keeps its own max, sum and unnormalized output, and the parts are
 * merged at the end. AVX2 + FMA + F16C; OpenMP over the items. No torch headers: called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_exp.h"

enum { KV_INT8 = 1, KV_E4M3 = 2, KV_E5M2 = 3, KV_F32 = 4, KV_BF16 = 5 };
#define MAX_D 256
#define MAX_G 8

/* 8 stored elements at p -> 8 fp32 (before the format's power-of-two factor). */
static inline __attribute__((always_inline)) __m256 load8(int fmt, const uint8_t *p) {
    if (fmt == KV_F32) return _mm256_loadu_ps((const float *)p);
    if (fmt == KV_BF16) /* a bfloat16 is the top half of a float32 */
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    if (fmt == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    if (fmt == KV_E5M2) return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), raw));
    __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7);
    return _mm256_cvtph_ps(_mm_andnot_si128(_mm_set1_epi16(0x4000), h));
}

static inline float fmt_factor(int fmt) { return fmt == KV_E4M3 ? 256.0f : 1.0f; }

/* Bytes per stored element. */
static inline int64_t esize(int fmt) { return fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1; }

/* Whether a block row carries scales after its data (the compact formats). */
static inline int scaled(int fmt) { return fmt <= KV_E5M2; }

/* [sum(v[0]), ..., sum(v[7])]: eight horizontal sums at once. */
static inline __m256 hsum8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Where one layer of one sequence's blocks is, and the shape of a block row. */
typedef struct {
    const uint8_t *layer;   /* raw + layer * layer_bytes: block i's row starts at layer + i * block_stride */
    int64_t block_stride;   /* bytes from one block to the next (L * layer_bytes) */
    int64_t data_bytes;     /* where the scales start inside a row */
    const int64_t *table;   /* this sequence's block ids */
    int64_t bs, kvh, d;
} Pool;

/* The row of the block holding token t. */
static inline const uint8_t *block_row(const Pool *p, int64_t t) {
    return p->layer + p->table[t / p->bs] * p->block_stride;
}

/* Ask for the row of the block holding token t ahead of use: blocks sit anywhere in the pool, so the
 * hardware prefetcher loses the stream at each one. */
static inline void prefetch_block(int fmt, const Pool *p, int64_t t) {
    const uint8_t *row = block_row(p, t);
    int64_t bytes = p->data_bytes + (scaled(fmt) ? p->bs * 2 * p->kvh * 4 : 0);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)row + i, _MM_HINT_T0);
}

/* Slot o's K (which = 0) or V (which = 1) elements of head h in a block row, and their scale (1
 * for a plain format). */
static inline __attribute__((always_inline)) const uint8_t *slot_of(int fmt, const Pool *p,
                                                                    const uint8_t *row, int64_t o,
                                                                    int which, int64_t h, float *scale) {
    int64_t i = (o * 2 + which) * p->kvh + h;
    *scale = scaled(fmt) ? ((const float *)(row + p->data_bytes))[i] : 1.0f;
    return row + i * p->d * esize(fmt);
}

/* Scores of head h for tokens [t, t + n) of one block (n <= 8, slots from o): s[g][i] = (q_g . k) * sk
 * * mul for G rows q [G][D]; mx[g] raised to their max. Eight dot products are reduced at once. */
static inline __attribute__((always_inline)) void scores8(int fmt, const int G, const Pool *p,
                                                          const uint8_t *row, int64_t o, int n, int64_t h,
                                                          const float *q, float mul, float *s, int64_t ld,
                                                          float *mx) {
    const int64_t D = p->d;
    __m256 part[MAX_G][8];
    float ks[8] = {0};
    for (int i = 0; i < 8; i++) {
        if (i >= n) {
            for (int g = 0; g < G; g++) part[g][i] = _mm256_setzero_ps();
            continue;
        }
        const uint8_t *k = slot_of(fmt, p, row, o + i, 0, h, &ks[i]);
        __m256 acc[MAX_G];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t j = 0; j < D; j += 8) {
            __m256 kv = load8(fmt, k + j * esize(fmt));
            for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + j), kv, acc[g]);
        }
        for (int g = 0; g < G; g++) part[g][i] = acc[g];
    }
    __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(ks), _mm256_set1_ps(mul));
    __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int g = 0; g < G; g++) {
        __m256 v = _mm256_mul_ps(hsum8(part[g]), sc);
        if (n == 8) {
            _mm256_storeu_ps(s + g * ld, v);
        } else {
            float out[8];
            _mm256_storeu_ps(out, v);
            memcpy(s + g * ld, out, n * sizeof(float));
        }
        float m = hmax(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, live));
        mx[g] = m > mx[g] ? m : mx[g];
    }
}

/* s[g][i] <- exp(s[g][i] - mx[g]) for i < n; returns the row sums in sum[g]. */
static void exponentiate(const int G, float *s, int64_t ld, int64_t n, const float *mx, float *sum) {
    for (int g = 0; g < G; g++) {
        float *row = s + g * ld;
        __m256 m = _mm256_set1_ps(mx[g]), acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), m));
            _mm256_storeu_ps(row + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        float total = hsum(acc);
        if (i < n) {
            float tmp[8] = {0};
            memcpy(tmp, row + i, (n - i) * sizeof(float));
            _mm256_storeu_ps(tmp, exp8(_mm256_sub_ps(_mm256_loadu_ps(tmp), m)));
            for (int64_t j = 0; j < n - i; j++) total += tmp[j];
            memcpy(row + i, tmp, (n - i) * sizeof(float));
        }
        sum[g] = total;
    }
}

/* o[g][:] += sum over slots [o0, o0 + n) of one block of w[g][i] * sv * mul * v, head h, for G rows;
 * D in chunks of CH vectors (G x CH accumulators in registers for the block's tokens). */
static inline __attribute__((always_inline)) void values_block(int fmt, const int G, const int CH,
                                                               const Pool *p, const uint8_t *row, int64_t o0,
                                                               int64_t n, int64_t h, const float *w,
                                                               int64_t ld, float mul, float *o) {
    const int64_t D = p->d;
    float wv[MAX_G][64];
    for (int64_t i = 0; i < n; i++) {
        float sv;
        slot_of(fmt, p, row, o0 + i, 1, h, &sv);
        for (int g = 0; g < G; g++) wv[g][i] = w[g * ld + i] * sv * mul;
    }
    for (int64_t j = 0; j < D; j += 8 * CH) {
        __m256 acc[MAX_G][8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) acc[g][c] = _mm256_loadu_ps(o + g * D + j + 8 * c);
        for (int64_t i = 0; i < n; i++) {
            float unused;
            const uint8_t *v = slot_of(fmt, p, row, o0 + i, 1, h, &unused) + j * esize(fmt);
            __m256 vv[8];
            for (int c = 0; c < CH; c++) vv[c] = load8(fmt, v + 8 * c * esize(fmt));
            for (int g = 0; g < G; g++) {
                __m256 wg = _mm256_set1_ps(wv[g][i]);
                for (int c = 0; c < CH; c++) acc[g][c] = _mm256_fmadd_ps(wg, vv[c], acc[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) _mm256_storeu_ps(o + g * D + j + 8 * c, acc[g][c]);
    }
}

/* Tokens [t0, t1) of one sequence, every KV head: po[h] = {o [G][D] unnormalized, max [G], sum [G]}.
 * One pass: block by block, each head's scores of the block's tokens, then their weighted V, while the
 * block's row is in cache (online softmax: when a block raises a row's max, what that row summed so
 * far is multiplied by e^(old max - new max)). q: [KVH][G][D] rotated. */
static inline __attribute__((always_inline)) void attend_range(int fmt, const int G, const Pool *p,
                                                               const float *q, int64_t t0, int64_t t1,
                                                               float scale, float *po) {
    const int CH = G <= 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1;
    const int64_t D = p->d, KVH = p->kvh, stride = G * D + 2 * G;
    float factor = fmt_factor(fmt);
    for (int64_t h = 0; h < KVH; h++) {
        memset(po + h * stride, 0, (G * D + 2 * G) * sizeof(float));
        for (int g = 0; g < G; g++) po[h * stride + G * D + g] = -INFINITY;
    }
    for (int64_t t = t0; t < t1;) {
        const uint8_t *row = block_row(p, t);
        int64_t o = t % p->bs, m = p->bs - o < t1 - t ? p->bs - o : t1 - t;
        if (t + m < t1) prefetch_block(fmt, p, t + m);
        for (int64_t h = 0; h < KVH; h++) {
            float sb[MAX_G][64], bmax[MAX_G], bsum[MAX_G];
            float *acc = po + h * stride, *mx = acc + G * D, *sum = mx + G;
            for (int g = 0; g < G; g++) bmax[g] = -INFINITY;
            for (int64_t i = 0; i < m; i += 8)
                scores8(fmt, G, p, row, o + i, m - i < 8 ? (int)(m - i) : 8, h, q + h * G * D,
                        scale * factor, sb[0] + i, 64, bmax);
            for (int g = 0; g < G; g++) {
                if (bmax[g] <= mx[g]) continue;
                float alpha = mx[g] == -INFINITY ? 0.0f : expf(mx[g] - bmax[g]);
                for (int64_t j = 0; j < D; j++) acc[g * D + j] *= alpha;
                sum[g] *= alpha;
                mx[g] = bmax[g];
            }
            exponentiate(G, sb[0], 64, m, mx, bsum);
            for (int g = 0; g < G; g++) sum[g] += bsum[g];
            values_block(fmt, G, CH, p, row, o, m, h, sb[0], 64, factor, acc);
        }
        t += m;
    }
}

static void attend_range_any(int fmt, int G, const Pool *p, const float *q, int64_t t0, int64_t t1,
                             float scale, float *po) {
#define KV_CASE_G(F, GG) \
    case GG: attend_range(F, GG, p, q, t0, t1, scale, po); return;
#define KV_CASE_F(F)                                                                    \
    switch (G) {                                                                        \
        KV_CASE_G(F, 1) KV_CASE_G(F, 2) KV_CASE_G(F, 3) KV_CASE_G(F, 4) KV_CASE_G(F, 5) \
        KV_CASE_G(F, 6) KV_CASE_G(F, 7) KV_CASE_G(F, 8) default: return;                \
    }
    if (fmt == KV_INT8) { KV_CASE_F(KV_INT8) }
    else if (fmt == KV_E4M3) { KV_CASE_F(KV_E4M3) }
    else if (fmt == KV_E5M2) { KV_CASE_F(KV_E5M2) }
    else if (fmt == KV_F32) { KV_CASE_F(KV_F32) }
    else { KV_CASE_F(KV_BF16) }
#undef KV_CASE_F
#undef KV_CASE_G
}

/* y[D] = x[D] @ R[D][D] (R row-major), or a copy without R. */
static void rotate(const float *x, const float *rot, int64_t D, float *y) {
    if (rot == NULL) {
        memcpy(y, x, D * sizeof(float));
        return;
    }
    for (int64_t j = 0; j < D; j += 8) _mm256_storeu_ps(y + j, _mm256_setzero_ps());
    for (int64_t i = 0; i < D; i++) {
        __m256 xi = _mm256_set1_ps(x[i]);
        for (int64_t j = 0; j < D; j += 8)
            _mm256_storeu_ps(y + j, _mm256_fmadd_ps(xi, _mm256_loadu_ps(rot + i * D + j), _mm256_loadu_ps(y + j)));
    }
}

/* Merge the parts of one (sequence, head): out[g] = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p,
 * unrotated into out rows of stride D. */
static void merge(const float *parts, int64_t nparts, int64_t stride, int G, int64_t D, const float *rot,
                  float *out) {
    for (int g = 0; g < G; g++) {
        float m = -INFINITY, l = 0.0f;
        for (int64_t i = 0; i < nparts; i++) m = fmaxf(m, parts[i * stride + G * D + g]);
        float acc[MAX_D] = {0};
        for (int64_t i = 0; i < nparts; i++) {
            const float *pp = parts + i * stride;
            float w = nparts == 1 ? 1.0f : expf(pp[G * D + g] - m);
            l += w * pp[G * D + G + g];
            for (int64_t j = 0; j < D; j++) acc[j] += w * pp[g * D + j];
        }
        float inv = 1.0f / l;
        for (int64_t j = 0; j < D; j++) acc[j] *= inv;
        rotate(acc, rot, D, out + g * D);
    }
}

/* Decode attention of B sequences over one layer of the pool (compact or plain).
 *   q:      [B, KVH * G, D] float32 (query heads h * G .. h * G + G - 1 share KV head h), not rotated;
 *           sequence b's rows start at q + b * ldq (heads contiguous: a view into the fused QKV rows)
 *   out:    [B, KVH * G, D] float32, in the model's basis (unrotated)
 *   tables: [B, max_blocks] int64 block ids; lens: [B] int64 context lengths (NULL: all max_context)
 *   rot:    [D, D] float32 or NULL; BS <= 64
 *   scratch: float32, at least B * KVH * (G * D + nparts * (G * D + 2 * G))
 *   nparts: context parts per sequence, >= 1 (more lets threads share one sequence) */
void kv_decode_attention(int fmt, const uint8_t *layer, int64_t block_stride, int64_t data_bytes,
                         const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t max_context,
                         const float *q, int64_t ldq, const float *rot, float *out, int64_t B, int64_t BS,
                         int64_t KVH, int64_t G, int64_t D, float scale, int64_t nparts, float *scratch, int threads) {
    int64_t head_stride = G * D + 2 * G, part_stride = KVH * head_stride;
    float *qr = scratch;                               /* [B, KVH, G, D] rotated queries */
    float *parts = qr + B * KVH * G * D;               /* [B, nparts, KVH, head_stride] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < KVH * G; r++) rotate(q + b * ldq + r * D, rot, D, qr + (b * KVH * G + r) * D);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < B * nparts; item++) {
        int64_t b = item / nparts, part = item % nparts;
        int64_t n = lens ? lens[b] : max_context;
        int64_t t0 = n * part / nparts, t1 = n * (part + 1) / nparts;
        float *po = parts + item * part_stride;
        if (t1 <= t0) { /* an empty part: weight 0 in the merge */
            memset(po, 0, part_stride * sizeof(float));
            for (int64_t h = 0; h < KVH; h++)
                for (int g = 0; g < G; g++) po[h * head_stride + G * D + g] = -INFINITY;
            continue;
        }
        Pool p = {layer, block_stride, data_bytes, tables + b * max_blocks, BS, KVH, D};
        attend_range_any(fmt, (int)G, &p, qr + b * KVH * G * D, t0, t1, scale, po);
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < KVH; h++)
            merge(parts + b * nparts * part_stride + h * head_stride, nparts, part_stride, (int)G, D, rot,
                  out + (b * KVH + h) * G * D);
}

/* ---------------------------------------------------------------------------------------------------
 * The compact write: quantize the step's new K|V rows (already rotated) and store codes and scales
 * into their slots, as kv_quant.quantize does in torch:
 *   int8: s = max(amax / 127, TINY); q = round-half-even(y / (s * factor)) clamped to +-127.
 *   fp8:  s = max(amax / qmax, TINY); of the S candidates c_k = s * steps[k], the one whose stored
 *         values fp8(clamp(y / (c_k * factor))) * c_k * factor are closest to y (least squared error,
 *         the first on a tie), codes converted with round-to-nearest-even like torch's.
 * The stored scale is s (int8) or c_k (fp8), without factor (1 except in the quality test's
 * deliberately broken quantizer).
 */
#define KV_TINY 1e-12f

static inline float from_fp8_slow(uint8_t c, int M, int B) {
    int e = (c & 0x7F) >> M, m = c & ((1 << M) - 1);
    float a = e == 0 ? ldexpf((float)m, 1 - B - M) : ldexpf(1.0f + ldexpf((float)m, -M), e - B);
    return c & 0x80 ? -a : a;
}

/* Every code's value, e4m3 and e5m2 (NaN/inf codes are never stored: writes clamp to +-max). */
static float FP8_VALUE[2][256];

__attribute__((constructor)) static void fill_fp8_values(void) {
    for (int c = 0; c < 256; c++) {
        FP8_VALUE[0][c] = from_fp8_slow((uint8_t)c, 3, 7);
        FP8_VALUE[1][c] = from_fp8_slow((uint8_t)c, 2, 15);
    }
}

/* 8 values (|v| <= qmax) -> their fp8 codes (one per 32-bit lane, sign in bit 7) and the values the
 * codes stand for; M mantissa bits, exponent bias B (e4m3: 3, 7; e5m2: 2, 15). Normal range: round
 * the fp32 mantissa to M bits, ties to even (masking the low bits then leaves the rounded value
 * itself); below it: scale to the subnormal steps and round (cvtps: MXCSR's default, ties to even). */
static inline __attribute__((always_inline)) __m256i fp8x8(__m256 v, int M, int B, __m256 *value) {
    const int shift = 23 - M;
    __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f)), a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    __m256i u = _mm256_castps_si256(a);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, shift), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32((1 << (shift - 1)) - 1), odd));
    __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(u, shift), _mm256_set1_epi32((127 - B) << M));
    __m256 normal_value = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(u, shift), shift));
    __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(ldexpf(1.0f, B - 1 + M))));
    __m256 sub_value = _mm256_mul_ps(_mm256_cvtepi32_ps(sub), _mm256_set1_ps(ldexpf(1.0f, 1 - B - M)));
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(ldexpf(1.0f, 1 - B)), _CMP_LT_OQ);
    __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), small));
    *value = _mm256_or_ps(_mm256_blendv_ps(normal_value, sub_value, small), sign);
    return _mm256_or_si256(code, _mm256_srli_epi32(_mm256_castps_si256(sign), 24));
}

/* The fp8 half of quantize_row: the best of the S candidate scales (M, B, qmax: the format); D % 8 == 0. */
static inline __attribute__((always_inline)) void quantize_fp8(int M, int B, float qmax, float amax,
                                                               const float *y, int64_t D, const float *steps,
                                                               int64_t S, float factor, uint8_t *codes,
                                                               float *scale, float *stored) {
    float s = fmaxf(amax / qmax, KV_TINY), best_err = INFINITY;
    int32_t trial[MAX_D], best_codes[MAX_D];
    int64_t best = 0;
    __m256 hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (int64_t k = 0; k < S; k++) {
        float t = s * steps[k] * factor;
        __m256 tv = _mm256_set1_ps(t), acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < D; j += 8) {
            __m256 yv = _mm256_loadu_ps(y + j), value;
            __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(yv, tv), lo), hi);
            _mm256_storeu_si256((__m256i *)(trial + j), fp8x8(q, M, B, &value));
            __m256 e = _mm256_sub_ps(_mm256_mul_ps(value, tv), yv);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(e, e));
        }
        float err = hsum(acc);
        if (err < best_err) {
            best_err = err;
            best = k;
            memcpy(best_codes, trial, D * sizeof(int32_t));
        }
    }
    *scale = s * steps[best];
    for (int64_t j = 0; j < D; j++) {
        codes[j] = (uint8_t)best_codes[j];
        if (stored) stored[j] = FP8_VALUE[M == 3 ? 0 : 1][codes[j]] * *scale;
    }
}

/* One row y[D] -> codes[D] and its scale; stored[D] (NULL: not wanted) = the values a read returns. */
static void quantize_row(int fmt, const float *y, int64_t D, const float *steps, int64_t S, float factor,
                         uint8_t *codes, float *scale, float *stored) {
    float amax = 0.0f;
    for (int64_t j = 0; j < D; j++) amax = fmaxf(amax, fabsf(y[j]));
    if (fmt == KV_INT8) {
        float s = fmaxf(amax / 127.0f, KV_TINY), t = s * factor;
        for (int64_t j = 0; j < D; j++) {
            float q = fminf(fmaxf(nearbyintf(y[j] / t), -127.0f), 127.0f);
            codes[j] = (uint8_t)(int8_t)q;
            if (stored) stored[j] = q * s;
        }
        *scale = s;
        return;
    }
    if (fmt == KV_E4M3)
        quantize_fp8(3, 7, 448.0f, amax, y, D, steps, S, factor, codes, scale, stored);
    else
        quantize_fp8(2, 15, 57344.0f, amax, y, D, steps, S, factor, codes, scale, stored);
}

/* y: [T, H2, D] K|V rows in the model's basis (H2 = 2 * KVH, K heads first; token t's rows start at
 * y + t * ldy), rotated here by rot ([D, D], or NULL: stored as they are) before quantizing; the pool
 * layer as in kv_decode_attention; slot t is row offsets[t] of block block_ids[t]. stored: the rows'
 * dequantized values [T, H2, D] (in the rotated basis) or NULL. One rotation for every
 * write (prefill chunks and decode steps alike), so a token's codes do not depend on how it was run.
 * fmt KV_BF16: a bfloat16 pool ([NB, L, BS, H2, D] elements; rot, steps and scales unused). */
/* fp32 -> bfloat16 rounded to nearest, ties to even; NaN -> 0x7FC0: torch's conversion, bit for bit. */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* A bfloat16 pool's write (kv_store_quantized with KV_BF16): each row rounded into its slot, no
 * rotation and no scale; stored: the rows as read back. */
static void store_bf16(const float *y, int64_t ldy, int64_t T, int64_t H2, int64_t D, uint8_t *layer,
                       int64_t block_stride, const int64_t *block_ids, const int64_t *offsets, float *stored) {
    for (int64_t t = 0; t < T; t++) {
        uint16_t *slot = (uint16_t *)(layer + block_ids[t] * block_stride) + offsets[t] * H2 * D;
        const float *src = y + t * ldy;
        for (int64_t j = 0; j < H2 * D; j++) {
            slot[j] = bf16_bits(src[j]);
            if (stored) {
                uint32_t u = (uint32_t)slot[j] << 16;
                memcpy(stored + t * H2 * D + j, &u, 4);
            }
        }
    }
}

void kv_store_quantized(int fmt, const float *y, int64_t ldy, int64_t T, int64_t H2, int64_t D,
                        const float *rot, const float *steps, int64_t S, float factor,
                        uint8_t *layer, int64_t block_stride, int64_t data_bytes, const int64_t *block_ids,
                        const int64_t *offsets, float *stored) {
    if (fmt == KV_BF16) {
        store_bf16(y, ldy, T, H2, D, layer, block_stride, block_ids, offsets, stored);
        return;
    }
    float buf[MAX_D] __attribute__((aligned(32)));
    for (int64_t t = 0; t < T; t++) {
        uint8_t *row = layer + block_ids[t] * block_stride;
        for (int64_t i = 0; i < H2; i++) {
            int64_t at = offsets[t] * H2 + i;
            float *scale = (float *)(row + data_bytes) + at;
            const float *src = y + t * ldy + i * D;
            if (rot) {
                rotate(src, rot, D, buf);
                src = buf;
            }
            quantize_row(fmt, src, D, steps, S, factor, row + at * D, scale,
                         stored ? stored + (t * H2 + i) * D : NULL);
        }
    }
}

/* codes[i] = the fp8 code of v[i] (|v[i]| <= the format's max; n % 8 == 0), as the compact write
 * rounds: tests compare it with torch's conversion at every grid point and every tie. */
void kv_fp8_codes(int fmt, const float *v, int64_t n, uint8_t *codes) {
    for (int64_t i = 0; i < n; i += 8) {
        __m256 value;
        int32_t lanes[8];
        __m256i c = fmt == KV_E4M3 ? fp8x8(_mm256_loadu_ps(v + i), 3, 7, &value)
                                   : fp8x8(_mm256_loadu_ps(v + i), 2, 15, &value);
        _mm256_storeu_si256((__m256i *)lanes, c);
        for (int j = 0; j < 8; j++) codes[i + j] = (uint8_t)lanes[j];
    }
}
