/* The squared norm of each record's weight gradient of a convolution with stride 1 and
   groups 1, from two pixel Gram matrices (ghost norms for convolutions; see
   fedlap_privacy/compute/ghost_clipping.py). Record n's gradient is A^T G, where row t of A is the
   unfolded input patch of output position t and row t of G the output gradient there, so
       |A^T G|^2 = <A A^T, G G^T>,
   and A A^T sums the input's pixel Gram matrix Q = X^T X (X: C x H*W) over the kernel's
   offsets: A A^T[t, t'] = sum_(u,v) Q[t + o_uv, t' + o_uv], with o_uv = (u dh - ph,
   v dw - pw) and zero where a shifted position falls into the padding. Hence
       |A^T G|^2 = sum_(u,v) sum_(t, t') Q[t + o_uv, t' + o_uv] GG[t, t'],
   which this kernel computes from Q (N, H*W, H*W) and GG = G G^T (N, Ho*Wo, Ho*Wo), the two
   batched matrix products the caller makes: 9 multiply-adds per entry of GG for a 3x3
   kernel, against C of them per entry for the Gram matrix of the unfolded columns. Both
   matrices are symmetric and a shift keeps the order of two positions, so only the pairs
   of output rows i <= i2 are visited (those with i < i2 twice), half the work. For each
   such pair the block of GG (i, i2) and, per kernel row u, the block of Q it meets are
   copied once into zero-padded scratch rows in the first-level cache (the padding stands
   for the positions a shift moves out of the map), and all kw column offsets run on them
   a vector at a time: every entry of the two matrices is read from memory a few times
   instead of once per offset.
   Records lo <= n < hi are handled, so that callers can split the work between threads;
   out[n] is written (1 is returned where the scratch cannot be allocated). Compiled by
   fedlap_privacy/compute/kernels/build.py once per scalar type (scalar_t, FN(name)), like
   gn_relu_pool.c. Returns 0. */

int FN(conv_gram_dot)(const scalar_t *restrict q, const scalar_t *restrict gg, int64_t H,
                      int64_t W, int64_t Ho, int64_t Wo, int64_t kh, int64_t kw, int64_t ph,
                      int64_t pw, int64_t dh, int64_t dw, int64_t lo, int64_t hi,
                      scalar_t *restrict out) {
    typedef scalar_t vec __attribute__((vector_size(32)));
    enum { VL = 32 / sizeof(scalar_t) };
    const int64_t P = H * W, T = Ho * Wo;
    /* The scratch rows of both blocks have one stride S: a Q row holds `left` zeros, the W
       values and zeros up to S, a GG row the Wo values and zeros. With S >= left + oxmax +
       Wo, one column offset's sum over the output columns j0 <= j < j1 and all k is then
       one dot product of (j1 - j0) S consecutive scalars: the terms whose shifted column
       leaves the map meet a zero of the Q row, those past Wo a zero of the GG row. */
    const int64_t left = pw > 0 ? pw : 0;
    const int64_t oxmax = (kw - 1) * dw - pw > 0 ? (kw - 1) * dw - pw : 0;
    const int64_t S = left + (W > Wo + oxmax ? W : Wo + oxmax);
    scalar_t *g = calloc((size_t)((Wo + W + 1) * S), sizeof(scalar_t));
    if (g == NULL)
        return 1;
    scalar_t *qb = g + Wo * S;
    for (int64_t n = lo; n < hi; ++n) {
        const scalar_t *restrict qn = q + n * P * P;
        const scalar_t *restrict gn = gg + n * T * T;
        double total = 0;
        for (int64_t i = 0; i < Ho; ++i)
            for (int64_t i2 = i; i2 < Ho; ++i2) {
                for (int64_t j = 0; j < Wo; ++j) {
                    const scalar_t *restrict src = gn + (i * Wo + j) * T + i2 * Wo;
                    scalar_t *restrict dst = g + j * S;
                    for (int64_t k = 0; k < Wo; ++k)
                        dst[k] = src[k];
                }
                /* four independent sums, not one chain of dependent additions */
                vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                double pair = 0;
                for (int64_t u = 0; u < kh; ++u) {
                    const int64_t a = i + u * dh - ph, b = i2 + u * dh - ph;
                    if (a < 0 || b < 0 || a >= H || b >= H)
                        continue;
                    for (int64_t c = 0; c < W; ++c) {
                        const scalar_t *restrict src = qn + (a * W + c) * P + b * W;
                        scalar_t *restrict dst = qb + c * S + left;
                        for (int64_t k = 0; k < W; ++k)
                            dst[k] = src[k];
                    }
                    for (int64_t v = 0; v < kw; ++v) {
                        const int64_t ox = v * dw - pw;
                        const int64_t j0 = ox < 0 ? -ox : 0, j1 = Wo < W - ox ? Wo : W - ox;
                        if (j1 <= j0)
                            continue;
                        const scalar_t *restrict x = qb + (j0 + ox) * S + left + ox;
                        const scalar_t *restrict y = g + j0 * S;
                        const int64_t len = (j1 - j0) * S;
                        int64_t k = 0;
                        for (; k + 4 * VL <= len; k += 4 * VL) {
                            vec x0, y0, x1, y1, x2, y2, x3, y3;
                            memcpy(&x0, x + k, sizeof x0);
                            memcpy(&y0, y + k, sizeof y0);
                            memcpy(&x1, x + k + VL, sizeof x1);
                            memcpy(&y1, y + k + VL, sizeof y1);
                            memcpy(&x2, x + k + 2 * VL, sizeof x2);
                            memcpy(&y2, y + k + 2 * VL, sizeof y2);
                            memcpy(&x3, x + k + 3 * VL, sizeof x3);
                            memcpy(&y3, y + k + 3 * VL, sizeof y3);
                            a0 += x0 * y0;
                            a1 += x1 * y1;
                            a2 += x2 * y2;
                            a3 += x3 * y3;
                        }
                        for (; k + VL <= len; k += VL) {
                            vec x0, y0;
                            memcpy(&x0, x + k, sizeof x0);
                            memcpy(&y0, y + k, sizeof y0);
                            a0 += x0 * y0;
                        }
                        for (; k < len; ++k)
                            pair += (double)x[k] * (double)y[k];
                    }
                }
                const vec acc = (a0 + a1) + (a2 + a3);
                for (int l = 0; l < VL; ++l)
                    pair += (double)acc[l];
                total += i == i2 ? pair : 2.0 * pair;
            }
        out[n] = (scalar_t)total;
    }
    free(g);
    return 0;
}
