/* kvtier weight kernels: y[M, N] (+)= x[M, K] @ W[N, K]^T with W stored quantized.
 *
 * W formats (one row = K/32 blocks of 32 weights, GGUF's own block types, little-endian):
 *   Q8_0 (qtype 8):  fp16 d, int8 q[32] per block              w = d * q            (34 bytes)
 *   Q4_0 (qtype 2):  fp16 d, uint8 qs[16] per block            w = d * (q - 8)      (18 bytes)
 *   Q4_1 (qtype 3):  fp16 d, fp16 m, uint8 qs[16] per block    w = d * q + m        (20 bytes)
 *     (4-bit: weight j < 16 is the low nibble of qs[j], weight j >= 16 the high nibble of qs[j-16])
 *   INT8 (qtype 100): int8 q[K] per row, fp32 scale[N]: w = q * scale[n]  (per-channel weight-only)
 *
 * A row holds its blocks' bytes regrouped by field (kvtier/models/qpack.py, the same bytes as the
 * GGUF file's blocks of that row): [d fp16 x nb | m fp16 x nb (Q4_1) | codes x nb]. The kernel converts
 * a row's scales to fp32 eight at a time into a small buffer and broadcasts each from there (a load),
 * where GGUF's interleaved layout costs three vector ops per scale per block.
 *
 * Every weight is dequantized in registers to the same fp32 value the dequantized model holds, then
 * multiplied with fp32 activations by FMA: the result equals the fp32 path up to summation order.
 * Rows of W are split over OpenMP threads; x rows are taken four at a time so a decoded block is reused.
 * AVX2 + FMA + F16C. No torch headers: called through ctypes with raw pointers.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define CHUNK 128 /* blocks whose scales are converted at once: a row is walked chunk by chunk */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, INT8 = 100 };

int64_t kv_block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case INT8: return 32;
    default: return -1;
    }
}

/* One row of W, its fields found: scales d and mins m (fp16, one per block; NULL when the format has
 * none) and the codes (code_bytes per block). */
typedef struct {
    const uint16_t *d, *m;
    const uint8_t *codes;
    int64_t code_bytes;
} Row;

static inline __attribute__((always_inline)) Row row_of(int qtype, const uint8_t *w, int64_t nb) {
    Row r = {NULL, NULL, w, qtype == Q8_0 || qtype == INT8 ? 32 : 16};
    if (qtype == INT8) return r;
    r.d = (const uint16_t *)w;
    r.m = qtype == Q4_1 ? r.d + nb : NULL;
    r.codes = w + (qtype == Q4_1 ? 4 : 2) * nb;
    return r;
}

static inline void fp16_to_fp32(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
}

/* fp32 scales (and mins) of blocks [b0, b0 + n) of a row: d[i], m[i]; INT8's row scale s for each. */
static inline __attribute__((always_inline)) void row_scales(int qtype, Row r, int64_t b0, int64_t n,
                                                             float s, float *d, float *m) {
    if (qtype == INT8) {
        for (int64_t i = 0; i < n; i++) d[i] = s;
        return;
    }
    fp16_to_fp32(r.d + b0, n, d);
    if (qtype == Q4_1) fp16_to_fp32(r.m + b0, n, m);
}

static inline __m256 i8x8(const int8_t *p) { /* 8 int8 -> 8 fp32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Decode one block's codes into w[0..3] (32 fp32 weights), its scale at dp and min at mp. */
static inline __attribute__((always_inline)) void decode(int qtype, const uint8_t *codes, const float *dp,
                                                         const float *mp, __m256 w[4]) {
    __m256 d = _mm256_broadcast_ss(dp);
    if (qtype == Q8_0 || qtype == INT8) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i8x8((const int8_t *)codes + 8 * i));
        return;
    }
    /* bytes 0..7 and 8..15 zero-extended to 32-bit lanes straight from memory; a lane's low nibble
     * is weight j, its high nibble weight j + 16 (no byte shuffles) */
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8)));
    __m256i mask = _mm256_set1_epi32(0x0F);
    __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(c, mask)),
                   _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4))};
    if (qtype == Q4_1) {
        __m256 m = _mm256_broadcast_ss(mp);
        for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, q[i], m);
    } else {
        __m256 eight = _mm256_set1_ps(8.0f);
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(q[i], eight));
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row n of W against ROWS (1..4, a compile-time constant after inlining) rows of x:
 * out[r] = x[r] . W[n]. Each x row keeps NACC accumulators, four for one or two rows (a block's
 * four FMAs then feed four independent chains: one chain of FMA latency per block, not two), two
 * for three or four rows (registers). */
static inline __attribute__((always_inline)) void row_dot(int qtype, const uint8_t *wrow, float s,
                                                          const float *x, int64_t ldx, const int ROWS,
                                                          int64_t K, float *out) {
    const int NACC = ROWS <= 2 ? 4 : 2;
    int64_t nb = K / QK;
    Row row = row_of(qtype, wrow, nb);
    float d[CHUNK], m[CHUNK];
    __m256 acc[4][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < NACC; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
        int64_t n = nb - b0 < CHUNK ? nb - b0 : CHUNK;
        row_scales(qtype, row, b0, n, s, d, m);
        for (int64_t i = 0; i < n; i++) {
            __m256 w[4];
            decode(qtype, row.codes + (b0 + i) * row.code_bytes, d + i, m + i, w);
            for (int r = 0; r < ROWS; r++) {
                const float *xb = x + r * ldx + (b0 + i) * QK;
                for (int j = 0; j < 4; j++)
                    acc[r][j % NACC] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % NACC]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        if (NACC == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(acc[r][2], acc[r][3]));
        out[r] = hsum(sum);
    }
}

/* The row-dot of one W row for one block type (a constant: the decoder is inlined per type). */
static inline __attribute__((always_inline)) void rows_dot(int qtype, const uint8_t *wrow, float s,
                                                           const float *x, int64_t K, int rows,
                                                           float *out) {
    switch (rows) {
    case 1: row_dot(qtype, wrow, s, x, K, 1, K, out); break;
    case 2: row_dot(qtype, wrow, s, x, K, 2, K, out); break;
    case 3: row_dot(qtype, wrow, s, x, K, 3, K, out); break;
    default: row_dot(qtype, wrow, s, x, K, 4, K, out); break;
    }
}

static void qmatmul_rows(int qtype, const uint8_t *w, const float *scale, const float *x, float *y,
                         int64_t M, int64_t N, int64_t K, int accumulate, int threads) {
    int64_t row_bytes = kv_block_bytes(qtype) * (K / QK);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = w + n * row_bytes;
        float s = scale ? scale[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int rows = M - m0 < 4 ? (int)(M - m0) : 4;
            float out[4];
            switch (qtype) {
            case Q8_0: rows_dot(Q8_0, wrow, s, x + m0 * K, K, rows, out); break;
            case Q4_0: rows_dot(Q4_0, wrow, s, x + m0 * K, K, rows, out); break;
            case Q4_1: rows_dot(Q4_1, wrow, s, x + m0 * K, K, rows, out); break;
            default: rows_dot(INT8, wrow, s, x + m0 * K, K, rows, out); break;
            }
            for (int r = 0; r < rows; r++) {
                float *dst = y + (m0 + r) * N + n;
                *dst = accumulate ? *dst + out[r] : out[r];
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W^T (accumulate != 0: y += ...). scale: [N] for INT8, else NULL. K % 32 == 0.
 * threads: OpenMP threads over the rows of W (1: run on the calling thread, no fork/join). */
void kv_qmatmul(int qtype, const uint8_t *w, const float *scale, const float *x, float *y, int64_t M,
                int64_t N, int64_t K, int accumulate, int threads) {
    qmatmul_rows(qtype, w, scale, x, y, M, N, K, accumulate, threads);
}

/* out[N, K] = W dequantized to fp32 (the weights the kernel above multiplies with). */
void kv_dequantize(int qtype, const uint8_t *w, const float *scale, float *out, int64_t N, int64_t K,
                   int threads) {
    int64_t nb = K / QK, row_bytes = kv_block_bytes(qtype) * nb;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        Row row = row_of(qtype, w + n * row_bytes, nb);
        float d[CHUNK], m[CHUNK];
        for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
            int64_t cnt = nb - b0 < CHUNK ? nb - b0 : CHUNK;
            row_scales(qtype, row, b0, cnt, scale ? scale[n] : 0.0f, d, m);
            for (int64_t i = 0; i < cnt; i++) {
                __m256 v[4];
                decode(qtype, row.codes + (b0 + i) * row.code_bytes, d + i, m + i, v);
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + n * K + (b0 + i) * QK + 8 * j, v[j]);
            }
        }
    }
}
