/* kvtier decode program: every layer of a decode step in one call from Python.
 *
 * A decode step of a small model spends ~8 calls a layer through ctypes (norm, qkv, RoPE + cache
 * write, attention, o, norm, gate|up, silu*up, down), each ~3-10 us of Python and ctypes around a
 * few microseconds of C: ~1.5 ms of a ~10 ms gguf step. This file only sequences those same C
 * functions (of fused.c, qmatmul.c and kvattn.c, passed in as function pointers) over the step's
 * buffers, layer after layer, with the same arguments the Python path passes them: the results are
 * bit for bit the Python path's (tests/test_decode_program.py). No arithmetic of its own but a bias
 * add, rounded like torch's.
 *
 * Per layer (x: [T, hidden] the residual stream, updated in place; T = the step's decode rows):
 *   h = rmsnorm(x, in_norm); qkv = h @ Wqkv (+ b); RoPE Q|K, K|V rows to their slots (a compact pool:
 *   rotated, quantized and scattered by kvattn.c's kv_store_quantized, as the Python path's write);
 *   attn = attention(q); x += attn @ Wo; h = rmsnorm(x, post_norm); gu = h @ Wgu; act = silu(g) * u;
 *   x += act @ Wdown
 */
#include <stdint.h>

typedef void (*rmsnorm_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, int64_t, float);
typedef void (*rope_store_fn)(float *, int64_t, const float *, const int64_t *, int64_t, int64_t, int64_t,
                              int64_t, int64_t, uint8_t *, const int64_t *);
typedef void (*rope_fn)(float *, int64_t, const float *, const int64_t *, int64_t, int64_t, int64_t);
typedef void (*store_fn)(int, const float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *,
                         int64_t, float, uint8_t *, int64_t, int64_t, const int64_t *, const int64_t *, float *);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t);
typedef void (*sgemv_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t,
                         int, int);
typedef void (*qmatmul_fn)(int, const uint8_t *, const float *, const float *, float *, int64_t, int64_t,
                           int64_t, int, int);
typedef void (*attention_fn)(int, const uint8_t *, int64_t, int64_t, const int64_t *, int64_t,
                             const int64_t *, int64_t, const float *, int64_t, const float *, float *,
                             int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float *, int);

/* One linear layer: kind 0 = quantized blocks (qmatmul), 1 = dense transposed fp32 (sgemv). */
typedef struct {
    int64_t kind, qid;
    const void *w;      /* quantized rows [N, ...] or w_t [K, N] */
    const float *scale; /* int8 per-row scales or NULL */
    const float *bias;  /* [N] or NULL */
    int64_t K, N, threads;
} Lin;

typedef struct {
    const float *in_norm, *post_norm;
    Lin qkv, o, gate_up, down;
} Layer;

typedef struct {
    void *rmsnorm, *rope_store, *silu_mul, *sgemv, *qmatmul, *attention; /* the ops */
    int64_t T, hidden, H, KVH, D, inter;
    float eps, scale;
    float *x, *h, *qkv, *gate_up, *act, *attn, *tmp; /* tmp: [T, hidden], a biased residual's product */
    const float *table;                              /* RoPE (cos, sin) [P, D/2, 2] */
    const int64_t *pos, *slots;                      /* [T] positions; [T] byte offsets of the slots */
    uint8_t *pool;                                   /* layer 0 of the KV pool */
    int64_t pool_layer_bytes;
    /* kv_decode_attention's per-step arguments (kvkernels.StepCall) */
    int64_t fmt, block_stride, data_bytes;
    const int64_t *tables;
    int64_t max_blocks;
    const int64_t *lens;
    int64_t max_context;
    const float *rot;
    int64_t block_size, parts, att_threads;
    float *scratch;
    /* a compact pool (fp8/int8): RoPE, then kv_store_quantized (rotate, quantize, scatter) instead of
     * rope_store; store is NULL for a plain float32 pool */
    void *rope, *store;
    const float *steps; /* the fp8 scale candidates' multipliers */
    int64_t nsteps;
    float factor;
    const int64_t *ids, *offsets; /* [T] slot block ids and rows */
} Step;

/* y [T, N] = x [T, K] @ W (+ b), or y += (x @ W (+ b)) when residual: as QuantLinear / DenseLinear do
 * it (a quantized weight with a bias: y = y + (x @ W + b), through tmp). */
static void linear(const Step *s, const Lin *l, const float *x, float *y, int residual) {
    int64_t T = s->T, N = l->N;
    if (l->kind == 1) {
        ((sgemv_fn)s->sgemv)(x, T, (const float *)l->w, l->bias, y, l->K, N, residual, (int)l->threads);
        return;
    }
    qmatmul_fn mm = (qmatmul_fn)s->qmatmul;
    if (l->bias == 0) {
        mm((int)l->qid, (const uint8_t *)l->w, l->scale, x, y, T, N, l->K, residual, (int)l->threads);
        return;
    }
    float *out = residual ? s->tmp : y;
    mm((int)l->qid, (const uint8_t *)l->w, l->scale, x, out, T, N, l->K, 0, (int)l->threads);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < N; j++) out[t * N + j] += l->bias[j];
    if (residual)
        for (int64_t i = 0; i < T * N; i++) y[i] = y[i] + out[i];
}

void kv_decode_layers(const Step *s, const Layer *layers, int64_t n_layers) {
    int64_t T = s->T, hidden = s->hidden, D = s->D;
    int64_t q_size = s->H * D, qkv_width = (s->H + 2 * s->KVH) * D;
    rmsnorm_fn norm = (rmsnorm_fn)s->rmsnorm;
    for (int64_t i = 0; i < n_layers; i++) {
        const Layer *l = layers + i;
        norm(s->x, hidden, l->in_norm, s->h, hidden, T, hidden, s->eps);
        linear(s, &l->qkv, s->h, s->qkv, 0);
        if (s->store) {
            ((rope_fn)s->rope)(s->qkv, qkv_width, s->table, s->pos, T, s->H + s->KVH, D);
            ((store_fn)s->store)((int)s->fmt, s->qkv + q_size, qkv_width, T, 2 * s->KVH, D, s->rot, s->steps,
                                 s->nsteps, s->factor, s->pool + i * s->pool_layer_bytes, s->block_stride,
                                 s->data_bytes, s->ids, s->offsets, 0);
        } else {
            ((rope_store_fn)s->rope_store)(s->qkv, qkv_width, s->table, s->pos, T, s->H + s->KVH, D, q_size,
                                           qkv_width - q_size, s->pool + i * s->pool_layer_bytes, s->slots);
        }
        ((attention_fn)s->attention)((int)s->fmt, s->pool + i * s->pool_layer_bytes, s->block_stride,
                                     s->data_bytes, s->tables, s->max_blocks, s->lens, s->max_context,
                                     s->qkv, qkv_width, s->rot, s->attn, T, s->block_size, s->KVH,
                                     s->H / s->KVH, D, s->scale, s->parts, s->scratch, (int)s->att_threads);
        linear(s, &l->o, s->attn, s->x, 1);
        norm(s->x, hidden, l->post_norm, s->h, hidden, T, hidden, s->eps);
        linear(s, &l->gate_up, s->h, s->gate_up, 0);
        ((silu_fn)s->silu_mul)(s->gate_up, s->act, T, s->inter);
        linear(s, &l->down, s->act, s->x, 1);
    }
}
