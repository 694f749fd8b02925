/* The decode products we write ourselves, built for the machine they run on (models/native.py).

   Batch-1 decode reads every weight once per token, so a step is as fast as its products
   stream weights. Three products are here because the kernels torch reaches do not stream
   them fast enough, or round activations more coarsely than llama.cpp (BENCHMARKS.md):

   - q4: Q4_0 weights times Q8_0 activations, as llama.cpp multiplies them. Weights: groups of
     32 along a row, 16 bytes each (byte j holds q[j] in its low nibble and q[j+16] in its
     high, q in 0..15, the weight (q - 8) * d) and one fp32 scale d per group. Activations: each
     row quantised per group of 32 to int8 with one scale (absmax / 127). A group's product is
     an integer dot product of 32 bytes by 32 bytes, scaled once. On x86
         sum_i (q_i - 8) x_i = sum_i q_i x_i - 8 sum_i x_i,
     so the weights' nibbles stay unsigned (what the x86 byte dot instructions take) and the
     offset is paid once per group through the activations' sum; Arm's dot is signed, so
     there the nibbles are shifted to -8..7 first.
   - int8: Q8_0 weights (int8 per group of 32, one fp16 scale each) times Q8_0 activations,
     llama.cpp's Q8_0 x Q8_0. fbgemm's dynamic int8 linear rounded a call's activations to 7
     bits with one scale for the whole tensor: 1.7x llama.cpp's logit error (issue 39).
   - fp32, one row: y = W x with W [n, k] row-major, a dot product per row, several rows
     streamed side by side (FROWS, below).

   Paths: AVX512 (VNNI) where there is one, AVX2, NEON with the dot-product instructions
   (__ARM_FEATURE_DOTPROD: Cortex-A76 and later, Apple silicon), plain NEON, plain C elsewhere
   (native.py does not use a plain-C build: torch's kernels are faster). Every row is summed
   in the same order whatever rows share its block, so a batched row's answer is its answer
   alone. Threads: OpenMP over the weight's rows, where the compiler has it. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define QK 32
#define ROWS 4 /* activation rows multiplied by one unpacked weight group */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes of weights ahead */
#endif

/* Which path this build multiplies with: 0 plain C (not used), 1 AVX2, 2 AVX512 (VNNI),
   3 NEON, 4 NEON with the dot-product instructions. */
int simd(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return 4;
#elif defined(__ARM_NEON)
    return 3;
#else
    return 0;
#endif
}

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

/* An IEEE half (Q8_0's weight scale) as float. */
static inline float half(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__ARM_NEON)
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return s ? -f : f;
    }
    bits = e == 31 ? s | 0x7f800000u | (m << 13) : s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if defined(__ARM_NEON)
/* 16 int8 by 16 int8 into 4 int32 partial sums: sdot, or widening multiplies without it. */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
    return vaddq_s32(acc, vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
#endif

#if defined(__AVX2__)
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* unsigned bytes u times signed bytes s, 32 of each: 8 int32 partial sums. */
static inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
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

/* Pairs alternate between two sums per row, so neither waits on the other's last add. */
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

/* One Q4_0 weight row against up to ROWS quantised activation rows. */
static void row_dot(const uint8_t *w, const float *dw, int ng, int m, const int8_t *qx, const float *dx,
                    const float *dsum, int k, float *out, int ldo) {
#if defined(__AVX2__)
    float corr[ROWS] = {0};
    __m256 acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < ng; g++) {
        __m128i p = _mm_loadu_si128((const __m128i *)(w + g * 16));
        __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low);
        for (int r = 0; r < m; r++) {
            __m256 s = _mm256_set1_ps(dw[g] * dx[r * ng + g]);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k + g * QK));
            acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot_us(wq, xv)), acc[r]);
            corr[r] += dw[g] * dsum[r * ng + g];
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = hsum8(acc[r]) - 8.f * corr[r];
#elif defined(__ARM_NEON)
    (void)dsum;
    float32x4_t acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = vdupq_n_f32(0.f);
    const uint8x16_t low = vdupq_n_u8(0x0F);
    const int8x16_t eight = vdupq_n_s8(8);
    for (int g = 0; g < ng; g++) {
        uint8x16_t b = vld1q_u8(w + g * 16);
        int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, low)), eight);
        int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), eight);
        for (int r = 0; r < m; r++) {
            const int8_t *x = qx + r * k + g * QK;
            int32x4_t s = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(x)), hi, vld1q_s8(x + 16));
            acc[r] = vmlaq_n_f32(acc[r], vcvtq_f32_s32(s), dw[g] * dx[r * ng + g]);
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = vaddvq_f32(acc[r]);
#else
    float corr[ROWS] = {0}, acc[ROWS] = {0};
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

/* Quantised activation rows, the scratch both low-bit products start from. */
typedef struct {
    int8_t *q;
    float *d, *dsum;
} Acts;

static int quantize_rows(const float *x, int m, int k, Acts *a) {
    int ng = k / QK;
    a->q = malloc((size_t)m * k);
    a->d = malloc(sizeof(float) * (size_t)m * ng);
    a->dsum = malloc(sizeof(float) * (size_t)m * ng);
    if (!a->q || !a->d || !a->dsum) {
        free(a->q), free(a->d), free(a->dsum);
        return -1;
    }
    for (int r = 0; r < m; r++)
        quantize_q8(x + (size_t)r * k, k, a->q + (size_t)r * k, a->d + (size_t)r * ng, a->dsum + (size_t)r * ng);
    return 0;
}

static void free_rows(Acts *a) { free(a->q), free(a->d), free(a->dsum); }

/* y [m, n] = x [m, k] times the Q4_0 weight [n, k]^T (qs [n, k/2] bytes, d [n, k/32]).
   Returns 0; -1 when the shape is not whole groups, -2 when memory ran out. */
int q4_0_mm(const float *x, int m, int k, const uint8_t *qs, const float *d, int n, float *y, int threads) {
    if (k < QK || k % QK || m < 1 || n < 1) return -1;
    int ng = k / QK;
    Acts a;
    if (quantize_rows(x, m, k, &a)) return -2;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (ng % 2 == 0) {
        Pair *px = aligned_alloc(64, sizeof(Pair) * (size_t)m * (ng / 2));
        if (px) {
            for (int r = 0; r < m; r++) prepare_pairs(a.q + (size_t)r * k, a.d + r * ng, ng, px + (size_t)r * (ng / 2));
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
            free(px), free_rows(&a);
            return 0;
        }
    }
#endif
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int j = 0; j < n; j++) {
        for (int r = 0; r < m; r += ROWS) {
            int mb = m - r < ROWS ? m - r : ROWS;
            row_dot(qs + (size_t)j * (k / 2), d + (size_t)j * ng, ng, mb, a.q + (size_t)r * k, a.d + r * ng,
                    a.dsum + r * ng, k, y + (size_t)r * n + j, n);
        }
    }
    free_rows(&a);
    return 0;
}

/* One Q8_0 weight row (int8 [k], fp16 scales [k/32]) against up to ROWS quantised activation rows. */
static inline __attribute__((always_inline)) void row_dot8(const int8_t *w, const uint16_t *dw, int ng, int m,
                                                           const int8_t *qx, const float *dx, int k, float *out,
                                                           int ldo) {
#if defined(__AVX2__)
    __m256 acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        _mm_prefetch((const char *)(w + g * QK + PREFETCH), _MM_HINT_T0);
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + g * QK));
        __m256i aw = _mm256_sign_epi8(wv, wv); /* |w| unsigned, x carries w's sign: what dpbusd takes */
        float dg = half(dw[g]);
        for (int r = 0; r < m; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k + g * QK));
            __m256i dot = dot_us(aw, _mm256_sign_epi8(xv, wv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dg * dx[r * ng + g]), _mm256_cvtepi32_ps(dot), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = hsum8(acc[r]);
#elif defined(__ARM_NEON)
    float32x4_t acc[ROWS];
    for (int r = 0; r < m; r++) acc[r] = vdupq_n_f32(0.f);
    for (int g = 0; g < ng; g++) {
        int8x16_t w0 = vld1q_s8(w + g * QK), w1 = vld1q_s8(w + g * QK + 16);
        float dg = half(dw[g]);
        for (int r = 0; r < m; r++) {
            const int8_t *x = qx + r * k + g * QK;
            int32x4_t s = dot16(dot16(vdupq_n_s32(0), w0, vld1q_s8(x)), w1, vld1q_s8(x + 16));
            acc[r] = vmlaq_n_f32(acc[r], vcvtq_f32_s32(s), dg * dx[r * ng + g]);
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = vaddvq_f32(acc[r]);
#else
    float acc[ROWS] = {0};
    for (int g = 0; g < ng; g++) {
        float dg = half(dw[g]);
        for (int r = 0; r < m; r++) {
            const int8_t *x = qx + r * k + g * QK;
            int dot = 0;
            for (int i = 0; i < QK; i++) dot += w[g * QK + i] * x[i];
            acc[r] += dg * dx[r * ng + g] * (float)dot;
        }
    }
    for (int r = 0; r < m; r++) out[r * ldo] = acc[r];
#endif
}

/* y [m, n] = x [m, k] times the Q8_0 weight [n, k]^T (q [n, k] int8, d [n, k/32] fp16 bits).
   Weights are -127..127 (the sign trick on x86 needs |w| to fit a byte). Returns 0; -1 when
   the shape is not whole groups, -2 when memory ran out. */
int q8_0_mm(const float *x, int m, int k, const int8_t *q, const uint16_t *d, int n, float *y, int threads) {
    if (k < QK || k % QK || m < 1 || n < 1) return -1;
    int ng = k / QK;
    Acts a;
    if (quantize_rows(x, m, k, &a)) return -2;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int j = 0; j < n; j++)
        for (int r = 0; r < m; r += ROWS) {
            const int8_t *wj = q + (size_t)j * k;
            const uint16_t *dj = d + (size_t)j * ng;
            const int8_t *xr = a.q + (size_t)r * k;
            const float *dr = a.d + (size_t)r * ng;
            float *yr = y + (size_t)r * n + j;
            switch (m - r < ROWS ? m - r : ROWS) { /* one copy per block size, unrolled */
            case 1: row_dot8(wj, dj, ng, 1, xr, dr, k, yr, n); break;
            case 2: row_dot8(wj, dj, ng, 2, xr, dr, k, yr, n); break;
            case 3: row_dot8(wj, dj, ng, 3, xr, dr, k, yr, n); break;
            default: row_dot8(wj, dj, ng, 4, xr, dr, k, yr, n);
            }
        }
    free_rows(&a);
    return 0;
}

/* fp32 weight rows streamed together by the one-row product: one core reads memory only as fast
   as it keeps misses in flight, and a single row is one sequential stream the hardware prefetcher
   runs ahead of by a bounded distance. FROWS rows side by side are FROWS streams: 1.17x the
   stream of one row at a time on the x86 machine of BENCHMARKS.md (docs/machine.md). AVX2 has 16
   registers, room for two rows' accumulators. */
#ifndef FROWS /* -DFROWS=n for an A/B */
#if defined(__AVX512F__) || defined(__ARM_NEON)
#define FROWS 4
#elif defined(__AVX2__)
#define FROWS 2
#else
#define FROWS 1
#endif
#endif

/* y[r] = w[r] . x for nr <= FROWS rows of w (row-major, k apart), each row summed in one order
   whatever rows share its block: per SIMD lane of 4 accumulators over chunks of 4 vectors, the
   accumulators added pairwise, the tail beyond the last whole chunk in order, after. */
static inline __attribute__((always_inline)) void gemv_rows(const float *x, int k, const float *w, int nr, float *y) {
    int i = 0;
    float sum[FROWS];
#if defined(__AVX512F__)
    __m512 a[FROWS][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (; i + 64 <= k; i += 64)
        for (int c = 0; c < 4; c++) {
            __m512 xv = _mm512_loadu_ps(x + i + 16 * c);
            for (int r = 0; r < nr; r++)
                a[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(w + (size_t)r * k + i + 16 * c), xv, a[r][c]);
        }
    for (int r = 0; r < nr; r++)
        sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
#elif defined(__AVX2__)
    __m256 a[FROWS][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
    for (; i + 32 <= k; i += 32)
        for (int c = 0; c < 4; c++) {
            __m256 xv = _mm256_loadu_ps(x + i + 8 * c);
            for (int r = 0; r < nr; r++)
                a[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (size_t)r * k + i + 8 * c), xv, a[r][c]);
        }
    for (int r = 0; r < nr; r++)
        sum[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
#elif defined(__ARM_NEON)
    float32x4_t a[FROWS][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) a[r][c] = vdupq_n_f32(0.f);
    for (; i + 16 <= k; i += 16)
        for (int c = 0; c < 4; c++) {
            float32x4_t xv = vld1q_f32(x + i + 4 * c);
            for (int r = 0; r < nr; r++) a[r][c] = vfmaq_f32(a[r][c], vld1q_f32(w + (size_t)r * k + i + 4 * c), xv);
        }
    for (int r = 0; r < nr; r++) sum[r] = vaddvq_f32(vaddq_f32(vaddq_f32(a[r][0], a[r][1]), vaddq_f32(a[r][2], a[r][3])));
#else
    for (int r = 0; r < nr; r++) sum[r] = 0.f;
#endif
    for (int r = 0; r < nr; r++) {
        float tail = 0.f;
        for (int t = i; t < k; t++) tail += w[(size_t)r * k + t] * x[t];
        y[r] = sum[r] + tail;
    }
}

/* y [n] = W [n, k] x [k], fp32, one row (decode): blocks of FROWS weight rows, the last rows one
   at a time. */
int f32_gemv(const float *x, int k, const float *w, int n, float *y, int threads) {
    if (k < 1 || n < 1) return -1;
    int blocks = (n + FROWS - 1) / FROWS;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; b++) {
        int j = b * FROWS;
        if (n - j >= FROWS)
            gemv_rows(x, k, w + (size_t)j * k, FROWS, y + j);
        else
            for (; j < n; j++) gemv_rows(x, k, w + (size_t)j * k, 1, y + j);
    }
    return 0;
}
