/* The squared norm of each record's weight gradient of a convolution with stride 1 and
   groups 1, from two pixel Gram matrices (ghost norms for convolutions; see
   fedlap_privacy/ghost_clipping.py). Record n's gradient is A^T G, where row t of A is the
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
   of output rows i <= i2 are visited (those with i < i2 twice), half the work.
   Records lo <= n < hi are handled, so that callers can split the work between threads;
   out[n] is written (1 is returned where the scratch row cannot be allocated). Compiled by fedlap_privacy/kernels/build.py once per scalar type
   (scalar_t, FN(name)), like gn_relu_pool.c. Returns 0. */

int FN(conv_gram_dot)(const scalar_t *restrict q, const scalar_t *restrict gg, int64_t H,
                      int64_t W, int64_t Ho, int64_t Wo, int64_t kh, int64_t kw, int64_t ph,
                      int64_t pw, int64_t dh, int64_t dw, int64_t lo, int64_t hi,
                      scalar_t *restrict out) {
    const int64_t P = H * W, T = Ho * Wo;
    /* per lane of the innermost loop (vectorised without a reduction), a partial sum over
       the pairs of one row i with itself (diag) and with the rows below it (below), added
       into a double once per output row and kernel offset */
    scalar_t *diag = malloc((size_t)(Wo > 0 ? 2 * Wo : 2) * sizeof(scalar_t));
    if (diag == NULL)
        return 1;
    scalar_t *below = diag + (Wo > 0 ? Wo : 1);
    for (int64_t n = lo; n < hi; ++n) {
        const scalar_t *restrict qn = q + n * P * P;
        const scalar_t *restrict gn = gg + n * T * T;
        double total = 0;
        for (int64_t u = 0; u < kh; ++u) {
            const int64_t oy = u * dh - ph;
            /* output rows i with 0 <= i + oy < H, columns j with 0 <= j + ox < W */
            const int64_t i0 = oy < 0 ? -oy : 0, i1 = Ho < H - oy ? Ho : H - oy;
            for (int64_t v = 0; v < kw; ++v) {
                const int64_t ox = v * dw - pw;
                const int64_t j0 = ox < 0 ? -ox : 0, j1 = Wo < W - ox ? Wo : W - ox;
                const int64_t len = j1 - j0;
                if (i1 <= i0 || len <= 0)
                    continue;
                for (int64_t i = i0; i < i1; ++i) {
                    for (int64_t k = 0; k < len; ++k)
                        diag[k] = 0, below[k] = 0;
                    for (int64_t j = j0; j < j1; ++j) {
                        const scalar_t *restrict qrow = qn + ((i + oy) * W + j + ox) * P;
                        const scalar_t *restrict grow = gn + (i * Wo + j) * T;
                        {
                            const scalar_t *restrict qa = qrow + (i + oy) * W + j0 + ox;
                            const scalar_t *restrict ga = grow + i * Wo + j0;
#pragma omp simd
                            for (int64_t k = 0; k < len; ++k)
                                diag[k] += qa[k] * ga[k];
                        }
                        for (int64_t i2 = i + 1; i2 < i1; ++i2) {
                            const scalar_t *restrict qa = qrow + (i2 + oy) * W + j0 + ox;
                            const scalar_t *restrict ga = grow + i2 * Wo + j0;
#pragma omp simd
                            for (int64_t k = 0; k < len; ++k)
                                below[k] += qa[k] * ga[k];
                        }
                    }
                    double row = 0;
                    for (int64_t k = 0; k < len; ++k)
                        row += (double)diag[k] + 2.0 * (double)below[k];
                    total += row;
                }
            }
        }
        out[n] = (scalar_t)total;
    }
    free(diag);
    return 0;
}
