/* Single-precision matrix products on operands as the Winograd transforms and the pixel Gram
   matrices lay them out, without packing them first and without a pass that zeroes the
   result (fedlap_privacy/kernels/tile_products.py says where each runs and why).

   Every product here is C(i, j) = sum_k A(i, k) B(k, j) with B's and C's rows
   contiguous along j, and A read one scalar at a time at any two strides. The inner kernel
   keeps a block of 6 rows and 16 columns of C in twelve AVX registers: per k it loads 16
   values of B's row k, broadcasts A(i, k) for the 6 rows and makes 12 fused multiply-adds
   (the register blocking of Goto & van de Geijn, "Anatomy of High-Performance Matrix
   Multiplication", ACM TOMS 2008, without their packed copies: the transforms already write
   each tile's channels contiguously). What decides the speed is the loop order around it:
   - tile_products: for each block of 6 tiles, all 36 points and all column blocks, so that
     the tiles are read once, as 6 sequential streams (looping over a few points at a time
     instead, so that their kernel matrices stay in the second-level cache, or over 12 to
     48 tiles per kernel matrix, so that it is read fewer times, was slower: more streams
     than the processor's prefetcher follows). The kernel matrices, read again for every 6
     tiles, come packed in panels of 16 columns (tile_products.py's pack), so that each
     panel is one contiguous run rather than 16 values every N. Sums of two products (the
     matching step's) stay with torch's: run through here, both pairs into the same
     registers, they were faster alone but slower with five clients side by side on the
     2 cores, where MKL's packed copies stay in the second-level cache;
   - gram_upper (a record's pixel Gram matrix X^T X): only the blocks on and above the
     diagonal of image rows, which is all that conv_gram.c reads of the symmetric matrix;
     gram_norms forms a record's two such matrices and reads them with conv_gram.c at once.
   The functions exist for float only and where the compiler targets AVX2 with FMA;
   elsewhere (and for double) they return 2 and the caller takes torch's batched product.
   (The weight gradient, a product summed over the tiles, stays with torch's: a version of
   it here, which copied 128 tiles at a time into panels, ran at 0.6 to 0.95 times its
   speed.) Each handles rows or records lo <= n < hi, so that callers can split the work
   between threads, and returns 0 (2 where it does not run, as above). Compiled by
   fedlap_privacy/kernels/build.py once per scalar type (scalar_t, FN(name)), like
   gn_relu_pool.c. */

#ifndef TILE_PRODUCTS_ONCE
#define TILE_PRODUCTS_ONCE
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TP_NATIVE 1

/* One product's operands: A(i, k) = a[i ai + k ak], B(k, j) = b[k bk + j], k < K. */
typedef struct {
    const float *a;
    int64_t ai, ak;
    const float *b;
    int64_t bk, K;
} tp_pair;

/* The lanes of two 8-wide registers that hold columns j < w (w <= 16). */
static inline void tp_masks(int64_t w, __m256i *m0, __m256i *m1) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    *m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)w), lanes);
    *m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)w - 8), lanes);
}

/* C(i0 + r, j0 + j) = sum_k A(i0 + r, k) B(k, j0 + j) for r < R, j < 16 (j < w where
   MASKED). R and MASKED are constants, so the accumulators stay in registers. */
#define TP_MICRO(R, MASKED)                                                                    \
    static void tp_micro_##R##_##MASKED(const tp_pair *pq, int64_t i0, int64_t j0, int64_t w,  \
                                        float *c, int64_t ci) {                                \
        __m256 s0[R], s1[R];                                                                   \
        __m256i m0 = _mm256_set1_epi32(-1), m1 = m0;                                          \
        if (MASKED)                                                                            \
            tp_masks(w, &m0, &m1);                                                             \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) s0[r] = s1[r] =                   \
            _mm256_setzero_ps();                                                               \
        const float *ar[R];                                                                    \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) ar[r] = pq->a + (i0 + r) * pq->ai; \
        const float *b = pq->b + j0;                                                           \
        const int64_t ak = pq->ak, bk = pq->bk;                                                \
        _Pragma("GCC unroll 2") for (int64_t k = 0; k < pq->K; ++k) {                         \
            const float *bp = b + k * bk;                                                      \
            const __m256 b0 = MASKED ? _mm256_maskload_ps(bp, m0) : _mm256_loadu_ps(bp);      \
            const __m256 b1 = MASKED ? _mm256_maskload_ps(bp + 8, m1) : _mm256_loadu_ps(bp + 8); \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) {                             \
                const __m256 av = _mm256_broadcast_ss(ar[r] + k * ak);                        \
                s0[r] = _mm256_fmadd_ps(av, b0, s0[r]);                                        \
                s1[r] = _mm256_fmadd_ps(av, b1, s1[r]);                                        \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) {                                 \
            float *cp = c + (i0 + r) * ci + j0;                                                \
            if (MASKED) {                                                                      \
                _mm256_maskstore_ps(cp, m0, s0[r]);                                            \
                _mm256_maskstore_ps(cp + 8, m1, s1[r]);                                        \
            } else {                                                                           \
                _mm256_storeu_ps(cp, s0[r]);                                                   \
                _mm256_storeu_ps(cp + 8, s1[r]);                                               \
            }                                                                                  \
        }                                                                                      \
    }
TP_MICRO(1, 0)
TP_MICRO(2, 0)
TP_MICRO(3, 0)
TP_MICRO(4, 0)
TP_MICRO(5, 0)
TP_MICRO(6, 0)
TP_MICRO(1, 1)
TP_MICRO(2, 1)
TP_MICRO(3, 1)
TP_MICRO(4, 1)
TP_MICRO(5, 1)
TP_MICRO(6, 1)
#undef TP_MICRO

typedef void (*tp_micro_fn)(const tp_pair *, int64_t, int64_t, int64_t, float *, int64_t);
static const tp_micro_fn tp_micros[2][6] = {
    {tp_micro_1_0, tp_micro_2_0, tp_micro_3_0, tp_micro_4_0, tp_micro_5_0, tp_micro_6_0},
    {tp_micro_1_1, tp_micro_2_1, tp_micro_3_1, tp_micro_4_1, tp_micro_5_1, tp_micro_6_1},
};

/* Rows i0 <= i < i0 + R (R <= 6) of C, columns j_lo <= j < N. */
static inline void tp_row_block(const tp_pair *pair, int64_t i0, int64_t R, int64_t j_lo,
                                int64_t N, float *c, int64_t ci) {
    for (int64_t j0 = j_lo; j0 < N; j0 += 16) {
        const int64_t w = N - j0 < 16 ? N - j0 : 16;
        tp_micros[w < 16][R - 1](pair, i0, j0, w, c, ci);
    }
}

/* out[i][p][j] = sum_k tiles[i][p][k] weights[p][k][j] for rows lo <= i < hi: tiles
   (rows, P, K) and out (rows, P, N) contiguous, weights packed (P, J, K, 16): J = ceil(N /
   16) panels of 16 columns, each K rows of 16 contiguous, the last zero-padded. */
static void tp_tile_products(const float *tiles, const float *weights, int64_t P, int64_t K,
                             int64_t N, int64_t lo, int64_t hi, float *out) {
    const int64_t J = (N + 15) / 16;
    for (int64_t i0 = lo; i0 < hi; i0 += 6) {
        const int64_t R = hi - i0 < 6 ? hi - i0 : 6;
        for (int64_t p = 0; p < P; ++p)
            for (int64_t j = 0; j < J; ++j) {
                const tp_pair panel = {tiles + p * K, P * K, 1, weights + (p * J + j) * K * 16,
                                       16, K};
                const int64_t w = N - 16 * j < 16 ? N - 16 * j : 16;
                tp_micros[w < 16][R - 1](&panel, i0, 0, w, out + p * N + 16 * j, P * N);
            }
    }
}

/* Q_n[t][u] = sum_c x_n[c][t] x_n[c][u] for records lo <= n < hi, x (N, C, T) and Q
   (N, T, T), on and above the diagonal blocks of image rows (rows of W positions): row t's
   columns from the first of its image row's block of 16 on; the rest of Q is not written. */
static void tp_gram_upper(const float *x, int64_t C, int64_t T, int64_t W, int64_t lo,
                          int64_t hi, float *q) {
    for (int64_t n = lo; n < hi; ++n) {
        const float *xn = x + n * C * T;
        const tp_pair pair = {xn, 1, T, xn, T, C};
        for (int64_t i0 = 0; i0 < T; i0 += 6) {
            const int64_t j_lo = (i0 / W) * W / 16 * 16;
            tp_row_block(&pair, i0, T - i0 < 6 ? T - i0 : 6, j_lo, T, q + n * T * T, T);
        }
    }
}
#endif
#endif

/* Whether the functions below run here for this scalar type (1) or return 2. */
int FN(tile_products_native)(void) {
#ifdef TP_NATIVE
    return sizeof(scalar_t) == sizeof(float);
#else
    return 0;
#endif
}

int FN(tile_products)(const scalar_t *tiles, const scalar_t *weights, int64_t P, int64_t K,
                      int64_t N, int64_t lo, int64_t hi, scalar_t *out) {
#ifdef TP_NATIVE
    if (sizeof(scalar_t) == sizeof(float)) {
        tp_tile_products((const float *)tiles, (const float *)weights, P, K, N, lo, hi,
                         (float *)out);
        return 0;
    }
#endif
    (void)tiles, (void)weights, (void)P, (void)K, (void)N, (void)lo, (void)hi, (void)out;
    return 2;
}

int FN(gram_upper)(const scalar_t *x, int64_t C, int64_t T, int64_t W, int64_t lo, int64_t hi,
                   scalar_t *q) {
#ifdef TP_NATIVE
    if (sizeof(scalar_t) == sizeof(float)) {
        tp_gram_upper((const float *)x, C, T, W, lo, hi, (float *)q);
        return 0;
    }
#endif
    (void)x, (void)C, (void)T, (void)W, (void)lo, (void)hi, (void)q;
    return 2;
}

/* Each record's squared weight-gradient norm of a stride-1 convolution (conv_gram.c), its
   two pixel Gram matrices formed by gram_upper one record at a time into scratch that stays
   in the second-level cache, and read there by conv_gram_dot, instead of all records'
   matrices written to memory and read back. x (N, Ci, H W) is the input, g (N, Co, Ho Wo)
   the output gradient; the rest is conv_gram_dot's geometry. The scratch starts as NaN, so
   that an entry read but not formed shows in the result. Returns 1 where the scratch
   cannot be allocated, 2 where the products do not run here (as above). */
int FN(gram_norms)(const scalar_t *x, int64_t Ci, int64_t H, int64_t W, const scalar_t *g,
                   int64_t Co, int64_t Ho, int64_t Wo, int64_t kh, int64_t kw, int64_t ph,
                   int64_t pw, int64_t dh, int64_t dw, int64_t lo, int64_t hi,
                   scalar_t *out) {
#ifdef TP_NATIVE
    if (sizeof(scalar_t) == sizeof(float)) {
        const int64_t P = H * W, T = Ho * Wo;
        float *q = malloc((size_t)(P * P + T * T) * sizeof(float));
        if (q == NULL)
            return 1;
        float *gg = q + P * P;
        for (int64_t e = 0; e < P * P + T * T; ++e)
            q[e] = NAN;
        for (int64_t n = lo; n < hi; ++n) {
            tp_gram_upper((const float *)x + n * Ci * P, Ci, P, W, 0, 1, q);
            tp_gram_upper((const float *)g + n * Co * T, Co, T, Wo, 0, 1, gg);
            const int code = FN(conv_gram_dot)((const scalar_t *)q, (const scalar_t *)gg, H, W,
                                               Ho, Wo, kh, kw, ph, pw, dh, dw, 0, 1, out + n);
            if (code != 0) {
                free(q);
                return code;
            }
        }
        free(q);
        return 0;
    }
#endif
    (void)x, (void)Ci, (void)H, (void)W, (void)g, (void)Co, (void)Ho, (void)Wo, (void)kh;
    (void)kw, (void)ph, (void)pw, (void)dh, (void)dw, (void)lo, (void)hi, (void)out;
    return 2;
}
