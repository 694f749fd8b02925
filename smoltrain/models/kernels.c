/* The rest of a one-row fp32 decode step, built with the products of q4_0.c (models/native.py):
   the norms, RoPE with the KV cache and attention, the MLP's activation.

   At one row each of these is a few thousand multiply-adds, while the torch operations they
   replace (about 25 a layer: norms, RoPE's muls and roll, the cache writes, attention, SiLU)
   cost 2-40 us each in dispatch: 1.7 ms of an 8 ms q4 step (BENCHMARKS.md). Portable C: the
   compiler vectorises the `omp simd` loops for AVX2/AVX512 and NEON alike (-fopenmp, or
   -fopenmp-simd where the compiler has no OpenMP runtime, Apple's clang). */

#include <math.h>
#include <stdlib.h>

/* Whether this build runs its loops on OpenMP threads (1) or on the calling thread alone (0). */
int openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* y = w * (x / sqrt(mean(x^2) + eps)), transformers' LlamaRMSNorm at fp32. */
void rms_norm_row(const float *x, const float *w, int k, float eps, float *y) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < k; i++) ss += x[i] * x[i];
    float r = 1.f / sqrtf(ss / (float)k + eps);
#pragma omp simd
    for (int i = 0; i < k; i++) y[i] = w[i] * (x[i] * r);
}

/* Rotate-half RoPE of one head: y = x cos + roll(x, hd/2) sin, with sin signed (llama.rope_table). */
static void rope_head(const float *x, const float *cos, const float *sin, int hd, float *y) {
    int h = hd / 2;
    for (int i = 0; i < h; i++) {
        y[i] = x[i] * cos[i] + x[i + h] * sin[i];
        y[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
    }
}

/* One new position of one sequence. qkv: [heads + 2 kv_heads, hd], the position's q, k, v heads;
   cos, sin: the RoPE table's row for `pos` (NULL: no RoPE, GPT-2); kc, vc: the cache [kv_heads, max_len, hd]. The
   rotated keys and the values go into the cache at `pos`; query head h attends over positions
   0..pos of kv head h / (heads / kv_heads), scaled by 1/sqrt(hd); out: [heads, hd].
   Returns -1 for a shape it cannot index (heads not a multiple of kv_heads, a position
   outside the cache: native.attend refuses those first), -2 where scratch memory ran out
   (nothing is written to out then). */
int attend_row(const float *qkv, int heads, int kv_heads, int hd, const float *cos, const float *sin, float *kc,
               float *vc, int max_len, int pos, float *out, int threads) {
    if (heads < 1 || kv_heads < 1 || kv_heads > heads || heads % kv_heads || hd < 1 || (cos && hd % 2) || pos < 0 ||
        pos >= max_len)
        return -1;
    int n = pos + 1, group = heads / kv_heads;
    float scale = 1.f / sqrtf((float)hd);
    for (int j = 0; j < kv_heads; j++) {
        size_t at = ((size_t)j * max_len + pos) * hd;
        const float *k = qkv + (size_t)(heads + j) * hd, *v = qkv + (size_t)(heads + kv_heads + j) * hd;
        for (int i = 0; i < hd; i++) kc[at + i] = k[i], vc[at + i] = v[i];
        if (cos) rope_head(k, cos, sin, hd, kc + at);
    }
    float *scratch = malloc(sizeof(float) * (size_t)heads * (n + hd));
    if (!scratch) return -2;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int h = 0; h < heads; h++) {
        float *s = scratch + (size_t)h * (n + hd), *q = s + n, *o = out + (size_t)h * hd;
        const float *K = kc + (size_t)(h / group) * max_len * hd, *V = vc + (size_t)(h / group) * max_len * hd;
        const float *qh = qkv + (size_t)h * hd;
        if (cos)
            rope_head(qh, cos, sin, hd, q);
        else
            for (int i = 0; i < hd; i++) q[i] = qh[i];
        float peak = -INFINITY, z = 0.f;
        for (int t = 0; t < n; t++) {
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int i = 0; i < hd; i++) d += q[i] * K[(size_t)t * hd + i];
            s[t] = d * scale;
            peak = fmaxf(peak, s[t]);
        }
        for (int t = 0; t < n; t++) z += (s[t] = expf(s[t] - peak));
        for (int i = 0; i < hd; i++) o[i] = 0.f;
        for (int t = 0; t < n; t++) {
            float p = s[t] / z;
#pragma omp simd
            for (int i = 0; i < hd; i++) o[i] += p * V[(size_t)t * hd + i];
        }
    }
    free(scratch);
    return 0;
}

/* y = (x - mean) / sqrt(var + eps) * w + b, torch's LayerNorm of one row (GPT-2). */
void layer_norm_row(const float *x, const float *w, const float *b, int k, float eps, float *y) {
    float sum = 0.f, sq = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < k; i++) sum += x[i];
    float mean = sum / (float)k;
#pragma omp simd reduction(+ : sq)
    for (int i = 0; i < k; i++) sq += (x[i] - mean) * (x[i] - mean);
    float r = 1.f / sqrtf(sq / (float)k + eps);
#pragma omp simd
    for (int i = 0; i < k; i++) y[i] = (x[i] - mean) * r * w[i] + b[i];
}

/* GELU of n values: tanh's approximation (GPT-2's gelu_new) when `tanh_approx`, else erf's. */
void gelu_row(const float *x, int n, int tanh_approx, float *y) {
    if (tanh_approx)
        for (int i = 0; i < n; i++)
            y[i] = 0.5f * x[i] * (1.f + tanhf(0.7978845608f * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
    else
        for (int i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678f));
}

/* y = silu(g) * u for gu = [g | u], f values each (the gate and up products' one matmul). */
void swiglu_row(const float *gu, int f, float *y) {
#pragma omp simd
    for (int i = 0; i < f; i++) y[i] = gu[i] / (1.f + expf(-gu[i])) * gu[f + i];
}
