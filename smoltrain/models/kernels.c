/* The decode kernels we write ourselves, built for the machine they run on (models/native.py).

   Batch-1 decode reads every weight once per token, so a step is as fast as its products
   stream weights. Two products are here because the kernels torch reaches do not stream
   them fast enough on the CPUs we measured (BENCHMARKS.md):

   - q4: Q4_0 weights times Q8_0 activations, as llama.cpp multiplies them. Weights: groups of
     32 along a row, 16 bytes each (byte j holds q[j] in its low nibble and q[j+16] in its
     high, q in 0..15, the weight (q - 8) * d) and one fp32 scale d per group. Activations: each
     row quantised per group of 32 to int8 with one scale (absmax / 127). A group's product is
     an integer dot product of 32 bytes by 32 bytes, scaled once:
         sum_i (q_i - 8) x_i = sum_i q_i x_i - 8 sum_i x_i,
     so the weights' nibbles stay unsigned (what the x86 byte dot instructions take) and the
     offset is paid once per group through the activations' sum.
   - fp32, one row: y = W x with W [n, k] row-major, a dot product per row.
   Below them, the rest of a one-row fp32 decode step (norms, RoPE, the cache, attention, activations).

   Paths: AVX512 (with VNNI for q4) where there is one, AVX2 otherwise, plain C elsewhere
   (native.py does not use a plain-C build: torch's kernels are faster). Threads: OpenMP over
   the weight's rows. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define ROWS 4 /* activation rows multiplied by one unpacked weight group */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes of weights ahead */
#endif

/* Q8_0 of one activation row: int8 values, a scale and the values' sum per group. */
static void quantize_q8(const float *x, int k, int8_t *q, float *d, float *dsum) {
    for (int g = 0; g < k / QK; g++) {
        const float *v = x + g * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int t = (int)roundf(v[i] * id);
            q[g * QK + i] = (int8_t)t;
            sum += t;
        }
        d[g] = dd;
        dsum[g] = dd * (float)sum;
    }
}

#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 nibbles of a group times 32 int8 activations: 8 int32 partial sums. */
static inline __m256i dot_group(__m256i w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
#endif
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* Two groups (64 weights) per step in 512-bit registers. The activations are laid out once
   per call to match the nibbles as they unpack, [g low 16, g+1 low 16, g high 16, g+1 high
   16], with each 4-byte lane's sum times -8 as dpbusd's starting value (the weights' offset)
   and each lane's activation scale. */
typedef struct {
    int8_t q[64];
    int32_t neg8sum[16];
    float d[16];
} Pair;

static void prepare_pairs(const int8_t *q, const float *d, int ng, Pair *out) {
    for (int p = 0; p < ng / 2; p++) {
        Pair *o = out + p;
        for (int h = 0; h < 2; h++)     /* low half of the groups' values, then high */
            for (int g = 0; g < 2; g++) /* group 2p, then 2p+1 */
                for (int i = 0; i < 16; i++) o->q[h * 32 + g * 16 + i] = q[(2 * p + g) * QK + h * 16 + i];
        for (int lane = 0; lane < 16; lane++) {
            int s = 0;
            for (int b = 0; b < 4; b++) s += o->q[lane * 4 + b];
            o->neg8sum[lane] = -8 * s;
            o->d[lane] = d[2 * p + (lane / 4) % 2];
        }
    }
}

static inline __m512i unpack_pair(const uint8_t *w) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)w);
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* A pair's two weight scales spread to its 16 lanes: [d0 x4, d1 x4, d0 x4, d1 x4]. */
static inline __m512 spread_scales(const float *dw) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)dw))));
}

static inline __m512 pair_product(__m512i wq, __m512 dwv, const Pair *a, __m512 acc) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(a->neg8sum), wq, _mm512_loadu_si512(a->q));
    return _mm512_fmadd_ps(_mm512_mul_ps(dwv, _mm512_loadu_ps(a->d)), _mm512_cvtepi32_ps(dot), acc);
}

/* Pairs alternate between two sums per row, so neither waits on the other's last add; every
   row is summed in the same order whatever rows share its block (a batched row's answer is
   the row's answer alone). */
static inline __attribute__((always_inline)) void row_dot_pairs(const uint8_t *w, const float *dw, int ng, int m,
                                                                const Pair *px, float *out, int ldo) {
    int np = ng / 2;
    __m512 a0[ROWS], a1[ROWS];
    for (int r = 0; r < m; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int p = 0;
    for (; p + 1 < np; p += 2) {
        _mm_prefetch((const char *)(w + p * 32 + PREFETCH), _MM_HINT_T0); /* the rows ahead: weights stream */
        _mm_prefetch((const char *)(dw + 2 * p + PREFETCH / 16), _MM_HINT_T0);
        __m512i w0 = unpack_pair(w + p * 32), w1 = unpack_pair(w + p * 32 + 32);
        __m512 d0 = spread_scales(dw + 2 * p), d1 = spread_scales(dw + 2 * p + 2);
        for (int r = 0; r < m; r++) {
            a0[r] = pair_product(w0, d0, px + (size_t)r * np + p, a0[r]);
            a1[r] = pair_product(w1, d1, px + (size_t)r * np + p + 1, a1[r]);
        }
    }
    if (p < np) {
        __m512i w0 = unpack_pair(w + p * 32);
        __m512 d0 = spread_scales(dw + 2 * p);
        for (int r = 0; r < m; r++) a0[r] = pair_product(w0, d0, px + (size_t)r * np + p, a0[r]);
    }
    for (int r = 0; r < m; r++) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}
#endif

/* One weight row against up to ROWS quantised activation rows. */
static void row_dot(const uint8_t *w, const float *dw, int ng, int m, const int8_t *qx, const float *dx,
                    const float *dsum, int k, float *out, int ldo) {
    float corr[ROWS] = {0};
#if defined(__AVX2__)
    __m256 acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < ng; g++) {
        __m128i p = _mm_loadu_si128((const __m128i *)(w + g * 16));
        __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low);
        for (int r = 0; r < m; r++) {
            __m256 s = _mm256_set1_ps(dw[g] * dx[r * ng + g]);
            acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot_group(wq, qx + r * k + g * QK)), acc[r]);
            corr[r] += dw[g] * dsum[r * ng + g];
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = hsum8(acc[r]) - 8.f * corr[r];
#else
    float acc[ROWS] = {0};
    for (int g = 0; g < ng; g++) {
        const uint8_t *p = w + g * 16;
        for (int r = 0; r < m; r++) {
            const int8_t *x = qx + r * k + g * QK;
            int dot = 0;
            for (int j = 0; j < 16; j++) dot += (p[j] & 0x0F) * x[j] + (p[j] >> 4) * x[j + 16];
            acc[r] += dw[g] * dx[r * ng + g] * (float)dot;
            corr[r] += dw[g] * dsum[r * ng + g];
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = acc[r] - 8.f * corr[r];
#endif
}

/* Which path this build multiplies with: 2 AVX512 (VNNI for q4), 1 AVX2, 0 plain C (not used). */
int simd(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] times the Q4_0 weight [n, k]^T (qs [n, k/2] bytes, d [n, k/32]).
   Returns 0, or -1 when k is not whole groups or memory ran out. */
int q4_0_mm(const float *x, int m, int k, const uint8_t *qs, const float *d, int n, float *y, int threads) {
    if (k % QK || m < 1) return -1;
    int ng = k / QK;
    int8_t *qx = malloc((size_t)m * k);
    float *dx = malloc(sizeof(float) * (size_t)m * ng), *dsum = malloc(sizeof(float) * (size_t)m * ng);
    if (!qx || !dx || !dsum) {
        free(qx), free(dx), free(dsum);
        return -1;
    }
    for (int r = 0; r < m; r++) quantize_q8(x + (size_t)r * k, k, qx + (size_t)r * k, dx + r * ng, dsum + r * ng);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (ng % 2 == 0) {
        Pair *px = aligned_alloc(64, sizeof(Pair) * (size_t)m * (ng / 2));
        if (px) {
            for (int r = 0; r < m; r++) prepare_pairs(qx + (size_t)r * k, dx + r * ng, ng, px + (size_t)r * (ng / 2));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int j = 0; j < n; j++)
                for (int r = 0; r < m; r += ROWS) {
                    const uint8_t *wj = qs + (size_t)j * (k / 2);
                    const float *dj = d + (size_t)j * ng;
                    const Pair *pr = px + (size_t)r * (ng / 2);
                    float *yr = y + (size_t)r * n + j;
                    switch (m - r < ROWS ? m - r : ROWS) { /* one copy per block size, unrolled */
                    case 1: row_dot_pairs(wj, dj, ng, 1, pr, yr, n); break;
                    case 2: row_dot_pairs(wj, dj, ng, 2, pr, yr, n); break;
                    case 3: row_dot_pairs(wj, dj, ng, 3, pr, yr, n); break;
                    default: row_dot_pairs(wj, dj, ng, 4, pr, yr, n);
                    }
                }
            free(px), free(qx), free(dx), free(dsum);
            return 0;
        }
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int j = 0; j < n; j++) {
        for (int r = 0; r < m; r += ROWS) {
            int mb = m - r < ROWS ? m - r : ROWS;
            row_dot(qs + (size_t)j * (k / 2), d + (size_t)j * ng, ng, mb, qx + (size_t)r * k, dx + r * ng,
                    dsum + r * ng, k, y + (size_t)r * n + j, n);
        }
    }
    free(qx), free(dx), free(dsum);
    return 0;
}

/* y [n] = W [n, k] x [k], fp32, one row (decode). */
int f32_gemv(const float *x, int k, const float *w, int n, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int j = 0; j < n; j++) {
        const float *r = w + (size_t)j * k;
        int i = 0;
        float tail = 0.f;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 64 <= k; i += 64) {
            for (int c = 0; c < 64; c += 16) /* the lines about to be read: 1.07x here, measured */
                _mm_prefetch((const char *)(r + i + c), _MM_HINT_T0);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 16), _mm512_loadu_ps(x + i + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 32), _mm512_loadu_ps(x + i + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 48), _mm512_loadu_ps(x + i + 48), a3);
        }
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 32 <= k; i += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r + i), _mm256_loadu_ps(x + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r + i + 8), _mm256_loadu_ps(x + i + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r + i + 16), _mm256_loadu_ps(x + i + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r + i + 24), _mm256_loadu_ps(x + i + 24), a3);
        }
        float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
        float sum = 0.f;
#endif
        for (; i < k; i++) tail += r[i] * x[i];
        y[j] = sum + tail;
    }
    return 0;
}

/* ---- the rest of a one-row fp32 decode step: the norms, RoPE with the KV cache and attention, the MLP's activation ----
   At one row each of these is a few thousand multiply-adds, while the torch operations they
   replace (about 25 a layer: norms, RoPE's muls and roll, the cache writes, attention, SiLU)
   cost 2-40 us each in dispatch: 1.7 ms of an 8 ms q4 step (BENCHMARKS.md). Plain C; the
   compiler vectorises the `omp simd` loops. */

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
   Returns 1 where scratch memory ran out (nothing is written to out then). */
int attend_row(const float *qkv, int heads, int kv_heads, int hd, const float *cos, const float *sin, float *kc,
               float *vc, int max_len, int pos, float *out, int threads) {
    int n = pos + 1, group = heads / kv_heads;
    float scale = 1.f / sqrtf((float)hd);
    for (int j = 0; j < kv_heads; j++) {
        size_t at = ((size_t)j * max_len + pos) * hd;
        const float *k = qkv + (size_t)(heads + j) * hd, *v = qkv + (size_t)(heads + kv_heads + j) * hd;
        for (int i = 0; i < hd; i++) kc[at + i] = k[i], vc[at + i] = v[i];
        if (cos) rope_head(k, cos, sin, hd, kc + at);
    }
    float *scratch = malloc(sizeof(float) * (size_t)heads * (n + hd));
    if (!scratch) return 1;
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
