/* The transforms of Winograd's minimal filtering F(m x m, 3x3) with m = 4 (Lavin & Gray,
   "Fast Algorithms for Convolutional Neural Networks", CVPR 2016) for a 3x3 convolution
   with stride 1 and padding 1 on maps whose height and width are multiples of m: the
   output is cut into m x m tiles, each computed from the (m + 2) x (m + 2) input tile
   around it as
       Y = A^T [ (G w G^T) . (B^T d B) ] A,
   summed over the input channels in the transformed domain (one matrix product per point
   xi = (m + 2) r + s of the tile; fedlap_privacy/compute/kernels/winograd.py makes them). The
   backward passes are the adjoints of the same bilinear map: the output gradient's tiles go
   to A g A^T, the input gradient is the overlap-add of B D B^T over the tiles, and the
   weight gradient is G^T M G of the products summed over the tiles.

   F(4x4, 3x3), with the interpolation points 0, 1, -1, 2, -2 and infinity:
       B^T = [4  0 -5  0 1 0;  0 -4 -4  1 1 0;  0  4 -4 -1 1 0;
              0 -2 -1  2 1 0;  0  2 -1 -2 1 0;  0  4  0 -5 0 1],
       G   = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1],
       A^T = [1 1 1 1 1 0;  0 1 -1 2 -2 0;  0 1 1 4 4 0;  0 1 -1 8 -8 1];
   Layouts: maps are (N, C, H, W), each record turned channels-last in a scratch block of the
   kernel (in the second-level cache: no pass over the batch in memory for the layout);
   a transformed tensor is (N, T, P, C) with
   T = (H/m) (W/m) tiles per record, row-major, and P = (m + 2)^2 points, so that each
   tile's points form one block, read and written in order; a transformed weight gradient
   is (R, C_out, P, C_in) and its result (R, C_out, C_in, 3, 3). Every function handles
   records (or weight-gradient rows) lo <= n < hi, so that callers can split the work
   between threads, and returns 0 (1 where its scratch block cannot be allocated). Each
   two-dimensional transform runs as two passes of a one-dimensional one (the rows of a
   tile, then its columns) through the scratch block, each pass a loop over the channels
   that the compiler vectorises; one pass for the whole 6x6 tile made a basic block too
   large to compile quickly. Compiled through kernels.c once per scalar
   type (scalar_t, FN(name)), like gn_relu_pool.c. */

#ifndef WINOGRAD_1D
#define WINOGRAD_1D
/* v -> B^T v (6 -> 6) */
#define WINO_BT(v, o)                                                                    \
    do {                                                                                 \
        (o)[0] = 4 * (v)[0] - 5 * (v)[2] + (v)[4];                                       \
        (o)[1] = -4 * ((v)[1] + (v)[2]) + (v)[3] + (v)[4];                               \
        (o)[2] = 4 * ((v)[1] - (v)[2]) - (v)[3] + (v)[4];                                \
        (o)[3] = 2 * ((v)[3] - (v)[1]) - (v)[2] + (v)[4];                                \
        (o)[4] = 2 * ((v)[1] - (v)[3]) - (v)[2] + (v)[4];                                \
        (o)[5] = 4 * (v)[1] - 5 * (v)[3] + (v)[5];                                       \
    } while (0)
/* v -> B v (6 -> 6), the adjoint of WINO_BT */
#define WINO_B(v, o)                                                                     \
    do {                                                                                 \
        (o)[0] = 4 * (v)[0];                                                             \
        (o)[1] = 4 * ((v)[2] - (v)[1] + (v)[5]) + 2 * ((v)[4] - (v)[3]);                 \
        (o)[2] = -5 * (v)[0] - 4 * ((v)[1] + (v)[2]) - (v)[3] - (v)[4];                  \
        (o)[3] = (v)[1] - (v)[2] + 2 * ((v)[3] - (v)[4]) - 5 * (v)[5];                   \
        (o)[4] = (v)[0] + (v)[1] + (v)[2] + (v)[3] + (v)[4];                             \
        (o)[5] = (v)[5];                                                                 \
    } while (0)
/* v -> A^T v (6 -> 4) */
#define WINO_AT(v, o)                                                                    \
    do {                                                                                 \
        const scalar_t p12 = (v)[1] + (v)[2], m12 = (v)[1] - (v)[2];                     \
        const scalar_t p34 = (v)[3] + (v)[4], m34 = (v)[3] - (v)[4];                     \
        (o)[0] = (v)[0] + p12 + p34;                                                     \
        (o)[1] = m12 + 2 * m34;                                                          \
        (o)[2] = p12 + 4 * p34;                                                          \
        (o)[3] = m12 + 8 * m34 + (v)[5];                                                 \
    } while (0)
/* v -> A v (4 -> 6), the adjoint of WINO_AT */
#define WINO_A(v, o)                                                                     \
    do {                                                                                 \
        const scalar_t e = (v)[0] + (v)[2], f = (v)[1] + (v)[3];                         \
        const scalar_t e4 = (v)[0] + 4 * (v)[2], f8 = 2 * (v)[1] + 8 * (v)[3];           \
        (o)[0] = (v)[0];                                                                 \
        (o)[1] = e + f;                                                                  \
        (o)[2] = e - f;                                                                  \
        (o)[3] = e4 + f8;                                                                \
        (o)[4] = e4 - f8;                                                                \
        (o)[5] = (v)[3];                                                                 \
    } while (0)
/* v -> G^T v (6 -> 3) */
#define WINO_GT(v, o)                                                                    \
    do {                                                                                 \
        const scalar_t p12 = (v)[1] + (v)[2], m12 = (v)[2] - (v)[1];                     \
        const scalar_t p34 = (v)[3] + (v)[4], m34 = (v)[3] - (v)[4];                     \
        (o)[0] = (v)[0] / 4 - p12 / 6 + p34 / 24;                                        \
        (o)[1] = m12 / 6 + m34 / 12;                                                     \
        (o)[2] = (p34 - p12) / 6 + (v)[5];                                               \
    } while (0)
/* v -> G v (3 -> 6) */
#define WINO_G(v, o)                                                                     \
    do {                                                                                 \
        const scalar_t p02 = (v)[0] + (v)[2];                                            \
        const scalar_t e = (v)[0] / 24 + (v)[2] / 6, f = (v)[1] / 12;                    \
        (o)[0] = (v)[0] / 4;                                                             \
        (o)[1] = -(p02 + (v)[1]) / 6;                                                    \
        (o)[2] = ((v)[1] - p02) / 6;                                                     \
        (o)[3] = e + f;                                                                  \
        (o)[4] = e - f;                                                                  \
        (o)[5] = (v)[2];                                                                 \
    } while (0)
#define WINO_M 4 /* the output tile's side */
#endif

#define ALPHA (WINO_M + 2)
#define POINTS (ALPHA * ALPHA)

/* A (R, K) matrix with rows `lds` apart to its (K, R) transpose with rows `ldd` apart, in
   8 x 8 blocks: one record's (C, P) map to (P, C) and back, a block of kernel tiles to the
   other layout. */
static void FN(wino_transpose_strided)(const scalar_t *restrict src, int64_t R, int64_t K,
                                       int64_t lds, scalar_t *restrict dst, int64_t ldd) {
    for (int64_t r0 = 0; r0 < R; r0 += 8)
        for (int64_t k0 = 0; k0 < K; k0 += 8)
            for (int64_t r = r0; r < r0 + 8 && r < R; ++r)
                for (int64_t k = k0; k < k0 + 8 && k < K; ++k)
                    dst[k * ldd + r] = src[r * lds + k];
}

static void FN(wino_transpose)(const scalar_t *restrict src, int64_t R, int64_t K,
                               scalar_t *restrict dst) {
    FN(wino_transpose_strided)(src, R, K, K, dst, R);
}

/* Input tiles: out[n][t][xi][c] = (B^T d B)[xi] for the tile d of record n whose top left
   corner is (m i - 1, m j - 1), zero outside the map (`zeros`: C zeros). */
int FN(wino_input)(const scalar_t *restrict x, int64_t N, int64_t C, int64_t H, int64_t W,
                   const scalar_t *restrict zeros, int64_t lo, int64_t hi,
                   scalar_t *restrict out) {
    const int64_t th = H / WINO_M, tw = W / WINO_M, T = th * tw;
    scalar_t *tmp = malloc((size_t)(POINTS + H * W) * C * sizeof(scalar_t));
    if (!tmp)
        return 1;
    scalar_t *rec = tmp + POINTS * C;
    (void)N;
    for (int64_t n = lo; n < hi; ++n) {
        FN(wino_transpose)(x + n * C * H * W, C, H * W, rec);
        for (int64_t i = 0; i < th; ++i)
            for (int64_t j = 0; j < tw; ++j) {
                scalar_t *restrict o = out + (n * T + i * tw + j) * POINTS * C;
                for (int r = 0; r < ALPHA; ++r) { /* rows: tmp[r][.] = B^T d[r][.] */
                    const scalar_t *p[ALPHA];
                    const int64_t y = WINO_M * i - 1 + r;
                    for (int s = 0; s < ALPHA; ++s) {
                        const int64_t z = WINO_M * j - 1 + s;
                        p[s] = (y < 0 || y >= H || z < 0 || z >= W)
                                   ? zeros : rec + (y * W + z) * C;
                    }
                    scalar_t *restrict t = tmp + ALPHA * r * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) v[k] = p[k][c];
                        WINO_BT(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) t[k * C + c] = u[k];
                    }
                }
                for (int s = 0; s < ALPHA; ++s) { /* columns: out[.][s] = B^T tmp[.][s] */
                    const scalar_t *restrict t = tmp + s * C;
                    scalar_t *restrict q = o + s * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k)
                            v[k] = t[ALPHA * k * C + c];
                        WINO_BT(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k)
                            q[ALPHA * k * C + c] = u[k];
                    }
                }
            }
    }
    free(tmp);
    return 0;
}

/* Output-gradient tiles: out[n][t][xi][c] = (A g A^T)[xi] for the m x m tile g of record n's
   gradient, the adjoint of the output transform. */
int FN(wino_grad_output)(const scalar_t *restrict g, int64_t N, int64_t C, int64_t H,
                         int64_t W, int64_t lo, int64_t hi, scalar_t *restrict out) {
    const int64_t th = H / WINO_M, tw = W / WINO_M, T = th * tw;
    scalar_t *tmp = malloc((size_t)(WINO_M * ALPHA + H * W) * C * sizeof(scalar_t));
    if (!tmp)
        return 1;
    scalar_t *rec = tmp + WINO_M * ALPHA * C;
    (void)N;
    for (int64_t n = lo; n < hi; ++n) {
        FN(wino_transpose)(g + n * C * H * W, C, H * W, rec);
        for (int64_t i = 0; i < th; ++i)
            for (int64_t j = 0; j < tw; ++j) {
                scalar_t *restrict o = out + (n * T + i * tw + j) * POINTS * C;
                for (int a = 0; a < WINO_M; ++a) { /* rows: tmp[a][.] = A g[a][.] */
                    const scalar_t *restrict g0 =
                        rec + ((WINO_M * i + a) * W + WINO_M * j) * C;
                    scalar_t *restrict t = tmp + ALPHA * a * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[WINO_M], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < WINO_M; ++k)
                            v[k] = g0[k * C + c];
                        WINO_A(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) t[k * C + c] = u[k];
                    }
                }
                for (int s = 0; s < ALPHA; ++s) { /* columns: out[.][s] = A tmp[.][s] */
                    const scalar_t *restrict t = tmp + s * C;
                    scalar_t *restrict q = o + s * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[WINO_M], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < WINO_M; ++k)
                            v[k] = t[ALPHA * k * C + c];
                        WINO_A(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k)
                            q[ALPHA * k * C + c] = u[k];
                    }
                }
            }
    }
    free(tmp);
    return 0;
}

/* Weight gradients: dw[r][o][i] (3x3) = G^T M G for M = m[r][o][.][i] (the points), rows
   lo <= r < hi of R. Each (r, o) row is computed into 9 rows of C_in (vectorised) and then
   interleaved into dw's (C_in, 3, 3) layout. */
int FN(wino_weight_grad)(const scalar_t *restrict m, int64_t R, int64_t Co, int64_t Ci,
                         int64_t lo, int64_t hi, scalar_t *restrict dw) {
    scalar_t *tmp = malloc((size_t)(3 * ALPHA + 9) * Ci * sizeof(scalar_t));
    if (!tmp)
        return 1;
    scalar_t *k9 = tmp + 3 * ALPHA * Ci;
    (void)R;
    for (int64_t r = lo; r < hi; ++r)
        for (int64_t o = 0; o < Co; ++o) {
            const scalar_t *restrict q = m + (r * Co + o) * POINTS * Ci;
            for (int a = 0; a < ALPHA; ++a) { /* rows: tmp[a][.] = G^T M[a][.] */
                const scalar_t *restrict b = q + ALPHA * a * Ci;
                scalar_t *restrict t = tmp + 3 * a * Ci;
#pragma omp simd
                for (int64_t i = 0; i < Ci; ++i) {
                    scalar_t v[ALPHA], u[3];
                    _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) v[k] = b[k * Ci + i];
                    WINO_GT(v, u);
                    t[i] = u[0], t[Ci + i] = u[1], t[2 * Ci + i] = u[2];
                }
            }
            for (int l = 0; l < 3; ++l) { /* columns: k9[.][l] = G^T tmp[.][l] */
                const scalar_t *restrict t = tmp + l * Ci;
                scalar_t *restrict k = k9 + l * Ci;
#pragma omp simd
                for (int64_t i = 0; i < Ci; ++i) {
                    scalar_t v[ALPHA], u[3];
                    _Pragma("GCC unroll 8") for (int a = 0; a < ALPHA; ++a)
                        v[a] = t[3 * a * Ci + i];
                    WINO_GT(v, u);
                    k[i] = u[0], k[3 * Ci + i] = u[1], k[6 * Ci + i] = u[2];
                }
            }
            scalar_t *restrict w = dw + (r * Co + o) * Ci * 9;
            for (int64_t i = 0; i < Ci; ++i)
                for (int k = 0; k < 9; ++k)
                    w[i * 9 + k] = k9[k * Ci + i];
        }
    free(tmp);
    return 0;
}

/* Kernel tiles: out[xi][o][i] = (G w G^T)[xi] of the 3x3 kernel w[o][i] (C_out, C_in, 3,
   3), for output channels lo <= o < hi, and the same values as outT[xi][i][o] (the forward
   products' operand; out is the input gradient's): the kernel's nine taps are laid out
   tap-major in a scratch block first, so that the loop over the input channels
   vectorises. */
int FN(wino_weight)(const scalar_t *restrict w, int64_t Co, int64_t Ci, int64_t lo,
                    int64_t hi, scalar_t *restrict out, scalar_t *restrict outT) {
    scalar_t *taps = malloc((size_t)(9 + 3 * ALPHA) * Ci * sizeof(scalar_t));
    if (!taps)
        return 1;
    scalar_t *rows = taps + 9 * Ci; /* rows[a][c][i] = (G w[.][c])[a] */
    for (int64_t o = lo; o < hi; ++o) {
        const scalar_t *restrict k = w + o * Ci * 9;
        for (int64_t i = 0; i < Ci; ++i)
            for (int t = 0; t < 9; ++t)
                taps[t * Ci + i] = k[i * 9 + t];
        for (int c = 0; c < 3; ++c) {
#pragma omp simd
            for (int64_t i = 0; i < Ci; ++i) {
                scalar_t v[3], u[ALPHA];
                v[0] = taps[c * Ci + i], v[1] = taps[(3 + c) * Ci + i];
                v[2] = taps[(6 + c) * Ci + i];
                WINO_G(v, u);
                _Pragma("GCC unroll 8") for (int a = 0; a < ALPHA; ++a)
                    rows[(a * 3 + c) * Ci + i] = u[a];
            }
        }
        for (int a = 0; a < ALPHA; ++a) {
            scalar_t *restrict dst = out + (a * ALPHA * Co + o) * Ci;
#pragma omp simd
            for (int64_t i = 0; i < Ci; ++i) {
                scalar_t v[3], u[ALPHA];
                v[0] = rows[(a * 3) * Ci + i], v[1] = rows[(a * 3 + 1) * Ci + i];
                v[2] = rows[(a * 3 + 2) * Ci + i];
                WINO_G(v, u);
                _Pragma("GCC unroll 8") for (int b = 0; b < ALPHA; ++b)
                    dst[b * Co * Ci + i] = u[b];
            }
        }
    }
    for (int a = 0; a < POINTS; ++a)
        FN(wino_transpose_strided)(out + (a * Co + lo) * Ci, hi - lo, Ci, Ci,
                                   outT + a * Ci * Co + lo, Co);
    free(taps);
    return 0;
}

/* Output tiles: y from the products m (N, T, 36, C): A^T m A per tile, plus
   the bias (C values; zeros where the convolution has none: a test inside the loop kept it
   from vectorising and made such a kernel 3x slower). */
int FN(wino_output)(const scalar_t *restrict m, const scalar_t *restrict bias, int64_t N,
                    int64_t C, int64_t H, int64_t W, int64_t lo, int64_t hi,
                    scalar_t *restrict y) {
    const int64_t th = H / WINO_M, tw = W / WINO_M, T = th * tw;
    scalar_t *tmp = malloc((size_t)(ALPHA * WINO_M + H * W) * C * sizeof(scalar_t));
    if (!tmp)
        return 1;
    scalar_t *rec = tmp + ALPHA * WINO_M * C;
    (void)N;
    for (int64_t n = lo; n < hi; ++n) {
        for (int64_t i = 0; i < th; ++i)
            for (int64_t j = 0; j < tw; ++j) {
                const scalar_t *restrict q = m + (n * T + i * tw + j) * POINTS * C;
                for (int r = 0; r < ALPHA; ++r) { /* rows: tmp[r][.] = A^T m[r][.] */
                    const scalar_t *restrict a = q + ALPHA * r * C;
                    scalar_t *restrict t = tmp + WINO_M * r * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[WINO_M];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) v[k] = a[k * C + c];
                        WINO_AT(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < WINO_M; ++k)
                            t[k * C + c] = u[k];
                    }
                }
                for (int b = 0; b < WINO_M; ++b) { /* columns: y[.][b] = A^T tmp[.][b] + bias */
                    const scalar_t *restrict t = tmp + b * C;
                    scalar_t *yp[WINO_M];
                    for (int a = 0; a < WINO_M; ++a)
                        yp[a] = rec + ((WINO_M * i + a) * W + WINO_M * j + b) * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[WINO_M];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k)
                            v[k] = t[WINO_M * k * C + c];
                        WINO_AT(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < WINO_M; ++k)
                            yp[k][c] = u[k] + bias[c];
                    }
                }
            }
        FN(wino_transpose)(rec, H * W, C, y + n * C * H * W);
    }
    free(tmp);
    return 0;
}

/* Input gradient from the transformed one d (N, T, 36, C): B D B^T per tile,
   added where the tiles overlap and cut to the map (the adjoint of the input transform).
   What falls outside the map is added to scratch rows (one per tile point, so that no two
   points of a tile share an address) and dropped. */
int FN(wino_grad_input)(const scalar_t *restrict d, int64_t N, int64_t C, int64_t H,
                        int64_t W, int64_t lo, int64_t hi, scalar_t *restrict dx) {
    const int64_t th = H / WINO_M, tw = W / WINO_M, T = th * tw;
    scalar_t *tmp = malloc((size_t)(2 * POINTS + H * W) * C * sizeof(scalar_t));
    if (!tmp)
        return 1;
    scalar_t *drop = tmp + POINTS * C, *rec = drop + POINTS * C;
    (void)N;
    for (int64_t n = lo; n < hi; ++n) {
        for (int64_t k = 0; k < H * W * C; ++k)
            rec[k] = 0;
        for (int64_t i = 0; i < th; ++i)
            for (int64_t j = 0; j < tw; ++j) {
                const scalar_t *restrict q = d + (n * T + i * tw + j) * POINTS * C;
                for (int r = 0; r < ALPHA; ++r) { /* rows: tmp[r][.] = B D[r][.] */
                    const scalar_t *restrict a = q + ALPHA * r * C;
                    scalar_t *restrict t = tmp + ALPHA * r * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) v[k] = a[k * C + c];
                        WINO_B(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) t[k * C + c] = u[k];
                    }
                }
                for (int s = 0; s < ALPHA; ++s) { /* columns: dx[.][s] += B tmp[.][s] */
                    const int64_t z = WINO_M * j - 1 + s;
                    scalar_t *p[ALPHA];
                    for (int r = 0; r < ALPHA; ++r) {
                        const int64_t y = WINO_M * i - 1 + r;
                        p[r] = (y < 0 || y >= H || z < 0 || z >= W)
                                   ? drop + (ALPHA * r + s) * C : rec + (y * W + z) * C;
                    }
                    const scalar_t *restrict t = tmp + s * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; ++c) {
                        scalar_t v[ALPHA], u[ALPHA];
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k)
                            v[k] = t[ALPHA * k * C + c];
                        WINO_B(v, u);
                        _Pragma("GCC unroll 8") for (int k = 0; k < ALPHA; ++k) p[k][c] += u[k];
                    }
                }
            }
        FN(wino_transpose)(rec, H * W, C, dx + n * C * H * W);
    }
    free(tmp);
    return 0;
}
#undef POINTS
#undef ALPHA
