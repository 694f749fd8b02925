/* The decode kernels (smoltrain/models/q4_0.c, kernels.c) on their own, no Python: built for
   aarch64 and run under qemu-user (dotprod and plain NEON), and built with AddressSanitizer and
   UBSan on this machine (tests/test_kernels_c.py). Each product against a float64 reference of
   the same arithmetic, a batched row (and the fp32 product's block of weight rows) against the
   row alone (bit for bit), the row kernels against float64, and the shapes the kernels must
   refuse. Prints "simd N" and "ok", or the first failure (exit 1). */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int simd(void);
int q4_0_mm(const float *x, int m, int k, const uint8_t *qs, const float *d, int n, float *y, int threads);
int q8_0_mm(const float *x, int m, int k, const int8_t *q, const uint16_t *d, int n, float *y, int threads);
int f32_gemv(const float *x, int k, const float *w, int n, float *y, int threads);
void rms_norm_row(const float *x, const float *w, int k, float eps, float *y);
int attend_row(const float *qkv, int heads, int kv_heads, int hd, const float *cos, const float *sin, float *kc,
               float *vc, int max_len, int pos, float *out, int threads);
void swiglu_row(const float *gu, int f, float *y);

static uint32_t seed = 12345;
static float rnd(void) { /* uniform in [-1, 1) */
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) / (float)(1 << 23) - 1.f;
}

static int fails;
static void check(int ok, const char *what, double got, double want) {
    if (!ok && fails++ < 5) printf("FAIL %s: got %.9g want %.9g\n", what, got, want);
}

/* The activation row at Q8_0, dequantised, in float64 (what the kernels multiply by). */
static void q8_ref(const float *x, int k, double *out) {
    for (int g = 0; g < k / 32; g++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[g * 32 + i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 32; i++) out[g * 32 + i] = (double)roundf(x[g * 32 + i] * id) * (double)d;
    }
}

static uint16_t to_half(float f) { /* normal range only: the scales here are */
    uint32_t b;
    memcpy(&b, &f, 4);
    uint32_t s = (b >> 16) & 0x8000, e = ((b >> 23) & 0xff) - 112, m = (b >> 13) & 0x3ff;
    return (uint16_t)(s | (e << 10) | m);
}
static double from_half(uint16_t h) { return ldexp((double)(1024 + (h & 0x3ff)), (int)((h >> 10) & 0x1f) - 25) * (h & 0x8000 ? -1 : 1); }

static void products(int n, int k, int m) {
    int ng = k / 32;
    float *x = malloc(sizeof(float) * m * k), *w = malloc(sizeof(float) * n * k), *d = malloc(sizeof(float) * n * ng);
    float *y = malloc(sizeof(float) * m * n), *y1 = malloc(sizeof(float) * n);
    uint8_t *qs = malloc((size_t)n * k / 2);
    int8_t *q8 = malloc((size_t)n * k);
    uint16_t *d8 = malloc(sizeof(uint16_t) * n * ng);
    double *xr = malloc(sizeof(double) * m * k), *wq = malloc(sizeof(double) * n * k), *w8 = malloc(sizeof(double) * n * k);
    for (int i = 0; i < m * k; i++) x[i] = rnd();
    for (int i = 0; i < n * k; i++) w[i] = rnd();
    for (int r = 0; r < m; r++) q8_ref(x + r * k, k, xr + r * k);
    for (int j = 0; j < n; j++)
        for (int g = 0; g < ng; g++) { /* Q4_0 and Q8_0 of the same weights */
            const float *v = w + j * k + g * 32;
            float peak = 0.f, amax = 0.f;
            for (int i = 0; i < 32; i++) {
                if (fabsf(v[i]) > fabsf(peak)) peak = v[i];
                amax = fmaxf(amax, fabsf(v[i]));
            }
            float dd = peak / -8.f, id = dd != 0.f ? 1.f / dd : 0.f;
            d[j * ng + g] = dd;
            uint16_t h = to_half(amax / 127.f);
            d8[j * ng + g] = h;
            for (int i = 0; i < 32; i++) {
                int q = (int)floorf(v[i] * id + 8.5f);
                q = q < 0 ? 0 : q > 15 ? 15 : q;
                wq[j * k + g * 32 + i] = (double)(q - 8) * dd;
                uint8_t *b = qs + (size_t)j * k / 2 + g * 16 + (i % 16);
                *b = i < 16 ? (uint8_t)q : (uint8_t)(*b | q << 4);
                int t = (int)roundf(v[i] * 127.f / amax);
                q8[j * k + g * 32 + i] = (int8_t)t;
                w8[j * k + g * 32 + i] = (double)t * from_half(h);
            }
        }
    for (int pass = 0; pass < 2; pass++) {
        const double *wr = pass ? w8 : wq;
        int rc = pass ? q8_0_mm(x, m, k, q8, d8, n, y, 2) : q4_0_mm(x, m, k, qs, d, n, y, 2);
        check(rc == 0, pass ? "q8_0_mm rc" : "q4_0_mm rc", rc, 0);
        double peak = 0, err = 0;
        for (int r = 0; r < m; r++)
            for (int j = 0; j < n; j++) {
                double ref = 0;
                for (int i = 0; i < k; i++) ref += xr[r * k + i] * wr[j * k + i];
                peak = fmax(peak, fabs(ref));
                err = fmax(err, fabs(ref - y[r * n + j]));
            }
        check(err < 1e-5 * peak, pass ? "q8_0 vs float64" : "q4_0 vs float64", err, peak);
        for (int r = 0; r < m; r++) { /* a row alone: the same bits */
            if (pass)
                q8_0_mm(x + r * k, 1, k, q8, d8, n, y1, 1);
            else
                q4_0_mm(x + r * k, 1, k, qs, d, n, y1, 1);
            check(memcmp(y1, y + r * n, sizeof(float) * n) == 0, pass ? "q8_0 row alone" : "q4_0 row alone", r, 0);
        }
    }
    f32_gemv(x, k, w, n, y1, 2);
    for (int j = 0; j < n; j++) {
        double ref = 0;
        for (int i = 0; i < k; i++) ref += (double)x[i] * w[j * k + i];
        check(fabs(ref - y1[j]) < 1e-4 * (1 + fabs(ref)), "f32_gemv vs float64", y1[j], ref);
    }
    check(q4_0_mm(x, m, k - 8, qs, d, n, y, 1) == -1, "q4_0_mm refuses k % 32", 0, -1);
    check(q8_0_mm(x, 0, k, q8, d8, n, y, 1) == -1, "q8_0_mm refuses m 0", 0, -1);
    free(x), free(w), free(d), free(y), free(y1), free(qs), free(q8), free(d8), free(xr), free(wq), free(w8);
}

/* The one-row fp32 product against float64, and each weight row's answer alone equal bit for bit
   to its answer in the blocks of rows the kernel streams together (any n, any k: remainders of
   both). */
static void gemv(int n, int k) {
    float *x = malloc(sizeof(float) * k), *w = malloc(sizeof(float) * n * k), *y = malloc(sizeof(float) * n), y1;
    for (int i = 0; i < k; i++) x[i] = rnd();
    for (int i = 0; i < n * k; i++) w[i] = rnd();
    check(f32_gemv(x, k, w, n, y, 2) == 0, "f32_gemv rc", 0, 0);
    for (int j = 0; j < n; j++) {
        double ref = 0;
        for (int i = 0; i < k; i++) ref += (double)x[i] * w[j * k + i];
        check(fabs(ref - y[j]) < 1e-4 * (1 + fabs(ref)), "f32_gemv vs float64", y[j], ref);
        f32_gemv(x, k, w + (size_t)j * k, 1, &y1, 1);
        check(memcmp(&y1, y + j, sizeof(float)) == 0, "f32_gemv row alone", y1, y[j]);
    }
    check(f32_gemv(x, 0, w, n, y, 1) == -1, "f32_gemv refuses k 0", 0, -1);
    free(x), free(w), free(y);
}

static void rows(void) {
    enum { K = 72, H = 6, KV = 2, HD = 8, L = 5, POS = 3 };
    float x[K], w[K], y[K], gu[2 * K], s[K];
    for (int i = 0; i < K; i++) x[i] = rnd(), w[i] = rnd();
    rms_norm_row(x, w, K, 1e-5f, y);
    double ss = 0;
    for (int i = 0; i < K; i++) ss += (double)x[i] * x[i];
    for (int i = 0; i < K; i++) check(fabs(y[i] - w[i] * x[i] / sqrt(ss / K + 1e-5)) < 1e-5, "rms_norm_row", y[i], 0);
    for (int i = 0; i < 2 * K; i++) gu[i] = 3 * rnd();
    swiglu_row(gu, K, s);
    for (int i = 0; i < K; i++) check(fabs(s[i] - gu[i] / (1 + exp(-gu[i])) * gu[K + i]) < 1e-5, "swiglu_row", s[i], 0);
    /* attention without RoPE, grouped heads (3 per kv head), over positions 0..POS */
    float qkv[(H + 2 * KV) * HD], kc[KV * L * HD], vc[KV * L * HD], out[H * HD];
    for (int i = 0; i < KV * L * HD; i++) kc[i] = rnd(), vc[i] = rnd();
    for (int i = 0; i < (H + 2 * KV) * HD; i++) qkv[i] = rnd();
    check(attend_row(qkv, H, KV, HD, NULL, NULL, kc, vc, L, POS, out, 2) == 0, "attend_row rc", 0, 0);
    for (int h = 0; h < H; h++) {
        const float *K_ = kc + (h / (H / KV)) * L * HD, *V = vc + (h / (H / KV)) * L * HD;
        double sc[POS + 1], z = 0, peak = -1e300;
        for (int t = 0; t <= POS; t++) {
            double dot = 0;
            for (int i = 0; i < HD; i++) dot += (double)qkv[h * HD + i] * K_[t * HD + i];
            sc[t] = dot / sqrt((double)HD);
            peak = fmax(peak, sc[t]);
        }
        for (int t = 0; t <= POS; t++) z += (sc[t] = exp(sc[t] - peak));
        for (int i = 0; i < HD; i++) {
            double o = 0;
            for (int t = 0; t <= POS; t++) o += sc[t] / z * V[t * HD + i];
            check(fabs(o - out[h * HD + i]) < 1e-5, "attend_row vs float64", out[h * HD + i], o);
        }
    }
    /* shapes the kernel must refuse: kv heads that do not divide the heads, more kv heads than
       heads, none, a position outside the cache */
    check(attend_row(qkv, 6, 4, HD, NULL, NULL, kc, vc, L, 0, out, 1) == -1, "refuses 6/4 heads", 0, -1);
    check(attend_row(qkv, 2, 4, HD, NULL, NULL, kc, vc, L, 0, out, 1) == -1, "refuses kv > heads", 0, -1);
    check(attend_row(qkv, 0, 0, HD, NULL, NULL, kc, vc, L, 0, out, 1) == -1, "refuses 0 heads", 0, -1);
    check(attend_row(qkv, H, KV, HD, NULL, NULL, kc, vc, L, L, out, 1) == -1, "refuses pos past cache", 0, -1);
}

int main(void) {
    printf("simd %d\n", simd());
    products(40, 96, 9);   /* an odd number of groups, 4-row blocks and their remainder */
    products(24, 256, 3);  /* an even number: AVX512's pairs */
    gemv(7, 83);           /* a block of rows and 3 alone; a tail past the last whole chunk */
    gemv(9, 200);
    gemv(3, 8);            /* rows alone only, shorter than one chunk */
    rows();
    if (fails) return 1;
    printf("ok\n");
    return 0;
}
