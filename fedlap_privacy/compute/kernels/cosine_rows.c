/* The gradient of the row-wise cosine distance of gradient matching (FedLAP-DP Eq. 9-10):
       D = sum_r w_r (1 - <a_r, b_r> / (|a_r| |b_r| + eps)) + mse * |a - b|^2
   with respect to b, where a (the real gradient) and b (the synthetic one) are flat
   vectors cut into rows r = [start[r], start[r + 1]). Per row, with den = |a| |b| + eps:
       dD/db = -w_r a / den + w_r <a, b> |a| b / (|b| den^2) - 2 mse (a - b),
   the second term left out where |b| = 0 (the cosine's derivative along b is undefined
   there). Two passes over each row: the dot product and |b|^2, then the gradient.

   Compiled by fedlap_privacy/compute/kernels/build.py once per scalar type (scalar_t, FN(name)),
   like gn_relu_pool.c. Rows r0 <= r < r1 are handled, so that callers can split the work
   between threads. Returns 0. */

int FN(cosine_rows_grad)(const scalar_t *restrict a, const scalar_t *restrict b,
                         const int64_t *restrict start, const scalar_t *restrict norm_a,
                         const scalar_t *restrict weight, double eps, double mse, int64_t r0,
                         int64_t r1, scalar_t *restrict grad) {
    const scalar_t two_mse = (scalar_t)(2.0 * mse);
    for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *restrict ar = a + start[r], *restrict br = b + start[r];
        scalar_t *restrict gr = grad + start[r];
        const int64_t len = start[r + 1] - start[r];
        scalar_t dot = 0, bb = 0;
#pragma omp simd reduction(+ : dot, bb)
        for (int64_t k = 0; k < len; ++k) {
            dot += ar[k] * br[k];
            bb += br[k] * br[k];
        }
        const scalar_t nb = (scalar_t)sqrt((double)bb);
        const scalar_t den = norm_a[r] * nb + (scalar_t)eps;
        const scalar_t along_a = weight[r] / den;
        const scalar_t along_b = nb > 0 ? weight[r] * dot * norm_a[r] / (nb * den * den) : 0;
#pragma omp simd
        for (int64_t k = 0; k < len; ++k)
            gr[k] = along_b * br[k] - along_a * ar[k] - two_mse * (ar[k] - br[k]);
    }
    return 0;
}
