/* Fused GroupNorm (one channel per group) -> ReLU -> 2x2 average pooling: the block that
   follows every convolution of the FedLAP-DP ConvNet (fedlap_privacy/models.py).

   One pass over each (n, c) plane instead of the seven to twenty passes of the separate
   torch kernels (forward, backward, and the backward of the backward that gradient
   matching needs); every plane of the ConvNet fits in the L1 cache, so the extra reads
   within a plane are free. Mathematics and the derivation of the double backward:
   docs/algorithms.md#fused-normalisation-block.

   This file is compiled through kernels.c, which defines
   scalar_t (float, double) and FN(name) (the exported name for that type) and includes
   it once per type. A plane p of an (N, C, H, W) tensor starts at p * H * W; its channel
   is p % C. Every function handles the planes p0 <= p < p1, so that callers can split the
   work between threads. The pooling floors odd sizes as torch's AvgPool2d(2, 2) does: the
   last row or column of an odd plane is normalised but pooled nowhere.

   Notation, per plane of M = H * W elements: mean mu, r = 1 / sqrt(var + eps) (population
   variance), xh = (z - mu) * r, a = gamma * xh + beta (computed as z * sc + sh with
   sc = r * gamma, sh = beta - mu * sc, as torch's kernel does), out = pool(relu(a)). */

/* mean and 1 / sqrt(var + eps) of one plane (two passes) */
static inline void FN(plane_stats)(const scalar_t *restrict zp, int64_t m, double eps,
                                   scalar_t *mu_out, scalar_t *r_out) {
    scalar_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < m; ++k) s += zp[k];
    const scalar_t mu = s / (scalar_t)m;
    scalar_t v = 0;
#pragma omp simd reduction(+ : v)
    for (int64_t k = 0; k < m; ++k) {
        const scalar_t d = zp[k] - mu;
        v += d * d;
    }
    *mu_out = mu;
    *r_out = (scalar_t)(1.0 / sqrt((double)v / (double)m + eps));
}

/* out = 2x2 average pooling of the h x w plane x (odd sizes floored: the last row or column
   of an odd plane is pooled nowhere), row by row */
static inline void FN(pool)(const scalar_t *restrict x, int64_t h, int64_t w,
                            scalar_t *restrict out) {
    const int64_t ho = h / 2, wo = w / 2;
    for (int64_t i = 0; i < ho; ++i) {
        const scalar_t *restrict q0 = x + 2 * i * w, *restrict q1 = q0 + w;
        scalar_t *restrict o = out + i * wo;
#pragma omp simd
        for (int64_t j = 0; j < wo; ++j)
            o[j] = (q0[2 * j] + q0[2 * j + 1] + q1[2 * j] + q1[2 * j + 1]) * (scalar_t)0.25;
    }
}

/* gu = the pooling's adjoint of the pooled plane gpp: each element gets 1/4 of its window's
   gradient, an element a floor drops 0. Written row by row, without a gather, so that the
   masked loops that read gu vectorise (an index gather inside them, with the ReLU's select,
   kept them scalar and branching on about half the elements). */
static inline void FN(unpool)(const scalar_t *restrict gpp, int64_t h, int64_t w,
                              scalar_t *restrict gu) {
    const int64_t ho = h / 2, wo = w / 2;
    for (int64_t i = 0; i < h; ++i) {
        scalar_t *restrict row = gu + i * w;
        if (i / 2 >= ho) {
            for (int64_t k = 0; k < w; ++k) row[k] = 0;
            continue;
        }
        const scalar_t *restrict src = gpp + (i / 2) * wo;
        for (int64_t j = 0; j < wo; ++j) {
            const scalar_t v = (scalar_t)0.25 * src[j];
            row[2 * j] = v;
            row[2 * j + 1] = v;
        }
        for (int64_t k = 2 * wo; k < w; ++k) row[k] = 0;
    }
}

/* scratch: one plane buffer; NULL when out of memory */
typedef struct {
    scalar_t *buf;
} FN(scratch_t);

static int FN(scratch_init)(FN(scratch_t) *s, int64_t h, int64_t w) {
    s->buf = malloc(sizeof(scalar_t) * (size_t)(h * w));
    return s->buf == NULL ? -1 : 0;
}

static void FN(scratch_free)(FN(scratch_t) *s) { free(s->buf); }

/* forward: out = pool(relu(a)); saves mu and r per plane. Returns 0, or -1 out of memory. */
int FN(gnrp_forward)(const scalar_t *restrict z, const scalar_t *restrict gamma,
                     const scalar_t *restrict beta, double eps, int64_t c, int64_t h, int64_t w,
                     int64_t p0, int64_t p1, scalar_t *restrict out, scalar_t *restrict mean,
                     scalar_t *restrict rstd) {
    const int64_t m = h * w, mo = (h / 2) * (w / 2);
    FN(scratch_t) s;
    if (FN(scratch_init)(&s, h, w)) return -1;
    scalar_t *restrict act = s.buf;
    for (int64_t p = p0; p < p1; ++p) {
        const scalar_t *restrict zp = z + p * m;
        scalar_t mu, r;
        FN(plane_stats)(zp, m, eps, &mu, &r);
        mean[p] = mu;
        rstd[p] = r;
        const scalar_t sc = r * gamma[p % c], sh = beta[p % c] - mu * sc;
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) {
            const scalar_t a = zp[k] * sc + sh;
            act[k] = a > 0 ? a : 0;
        }
        FN(pool)(act, h, w, out + p * mo);
    }
    FN(scratch_free)(&s);
    return 0;
}

/* backward, from gp = dL/dout: gy = dL/da = [a > 0] weight * gp[up] and
       gz = sc * (gy - mean(gy) - xh * mean(gy * xh)),
   and per plane sgx = sum gy * xh, sgy = sum gy (the plane's, i.e. one record's, share of
   dL/dgamma and dL/dbeta). Returns 0, or -1 out of memory. */
int FN(gnrp_backward)(const scalar_t *restrict z, const scalar_t *restrict gp,
                      const scalar_t *restrict gamma, const scalar_t *restrict beta,
                      const scalar_t *restrict mean, const scalar_t *restrict rstd, int64_t c,
                      int64_t h, int64_t w, int64_t p0, int64_t p1, scalar_t *restrict gz,
                      scalar_t *restrict sgx, scalar_t *restrict sgy) {
    const int64_t m = h * w, mo = (h / 2) * (w / 2);
    FN(scratch_t) s;
    if (FN(scratch_init)(&s, h, w)) return -1;
    scalar_t *restrict gu = s.buf;
    for (int64_t p = p0; p < p1; ++p) {
        const scalar_t *restrict zp = z + p * m, *restrict gpp = gp + p * mo;
        scalar_t *restrict gzp = gz + p * m;
        const scalar_t mu = mean[p], r = rstd[p];
        const scalar_t sc = r * gamma[p % c], sh = beta[p % c] - mu * sc;
        FN(unpool)(gpp, h, w, gu);
        scalar_t s_gy = 0, s_gyx = 0;
#pragma omp simd reduction(+ : s_gy, s_gyx)
        for (int64_t k = 0; k < m; ++k) {
            const scalar_t g = zp[k] * sc + sh > 0 ? gu[k] : 0;
            gzp[k] = g;
            s_gy += g;
            s_gyx += g * ((zp[k] - mu) * r);
        }
        sgy[p] = s_gy;
        sgx[p] = s_gyx;
        const scalar_t k1 = s_gy / (scalar_t)m, k2 = s_gyx / (scalar_t)m;
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) gzp[k] = sc * (gzp[k] - k1 - (zp[k] - mu) * r * k2);
    }
    FN(scratch_free)(&s);
    return 0;
}

/* double backward. The backward above is a function B(z, gp, gamma) -> (gz, dgamma, dbeta)
   with dgamma = sum sgx, dbeta = sum sgy over the batch. Given u = dL/dgz and, per
   channel, ug = dL/d(dgamma), ub = dL/d(dbeta), it returns dz = dL/dz, dgp = dL/dgp and,
   per plane, dgam = the plane's share of dL/dgamma (dL/dbeta is 0: beta moves only the
   ReLU's kinks, where the derivative is not defined). With the plane sums
   Su = sum u, Sgy = sum gy, Sux = sum u xh, Sgyx = sum gy xh, Sugy = sum u gy and
   core = Sugy - Sgy Su / M - Sgyx Sux / M:
       dL/dgy = sc (u - Su/M - xh Sux/M) + ug xh + ub, dgp = pool([a > 0] dL/dgy),
       dz = r (al_gy gy + al_u u - abar - xh axh) - (r/M) xh gamma r core,
   where al_u = -(r/M) gamma Sgyx, al_gy = -(r/M) gamma Sux + ug,
   abar = (al_gy Sgy + al_u Su) / M, axh = (al_gy Sgyx + al_u Sux) / M, and dgam = r core.
   Returns 0, or -1 out of memory. */
int FN(gnrp_double_backward)(const scalar_t *restrict z, const scalar_t *restrict gp,
                             const scalar_t *restrict gamma, const scalar_t *restrict beta,
                             const scalar_t *restrict mean, const scalar_t *restrict rstd,
                             const scalar_t *restrict u, const scalar_t *restrict ug,
                             const scalar_t *restrict ub, int64_t c, int64_t h, int64_t w,
                             int64_t p0, int64_t p1, scalar_t *restrict dz,
                             scalar_t *restrict dgp, scalar_t *restrict dgam) {
    const int64_t m = h * w, mo = (h / 2) * (w / 2);
    const scalar_t inv_m = (scalar_t)1 / (scalar_t)m;
    FN(scratch_t) s;
    if (FN(scratch_init)(&s, h, w)) return -1;
    scalar_t *restrict t = s.buf;
    for (int64_t p = p0; p < p1; ++p) {
        const scalar_t *restrict zp = z + p * m, *restrict up_l = u + p * m;
        const scalar_t *restrict gpp = gp + p * mo;
        scalar_t *restrict dzp = dz + p * m;
        const scalar_t ga = gamma[p % c], mu = mean[p], r = rstd[p];
        const scalar_t sc = r * ga, sh = beta[p % c] - mu * sc, ug_c = ug[p % c], ub_c = ub[p % c];
        /* pass 1: gy (kept in dz until pass 2 overwrites it) and the five plane sums */
        FN(unpool)(gpp, h, w, t); /* pass 2 overwrites t after pass 1 has read it */
        scalar_t su = 0, sgy = 0, sux = 0, sgyx = 0, sugy = 0;
#pragma omp simd reduction(+ : su, sgy, sux, sgyx, sugy)
        for (int64_t k = 0; k < m; ++k) {
            const scalar_t xh = (zp[k] - mu) * r;
            const scalar_t g = zp[k] * sc + sh > 0 ? t[k] : 0;
            dzp[k] = g;
            su += up_l[k];
            sgy += g;
            sux += up_l[k] * xh;
            sgyx += g * xh;
            sugy += up_l[k] * g;
        }
        const scalar_t core = sugy - sgy * su * inv_m - sgyx * sux * inv_m;
        dgam[p] = r * core;
        const scalar_t al_u = -r * inv_m * ga * sgyx, al_gy = -r * inv_m * ga * sux + ug_c;
        const scalar_t abar = (al_gy * sgy + al_u * su) * inv_m;
        const scalar_t axh = (al_gy * sgyx + al_u * sux) * inv_m;
        const scalar_t gy0 = -sc * su * inv_m + ub_c, gyx = -sc * sux * inv_m + ug_c;
        const scalar_t z_gy = r * al_gy, z_u = r * al_u, z0 = -r * abar;
        const scalar_t zx = -r * axh - r * inv_m * ga * r * core;
        /* pass 2: dL/dgy, and dz; then dL/dgy kept where the ReLU passes (pooled below). The
           mask is a loop of its own: inside the first, GCC keeps the select as a branch
           (the loop stays scalar) */
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) {
            const scalar_t xh = (zp[k] - mu) * r;
            t[k] = sc * up_l[k] + gyx * xh + gy0;
            dzp[k] = z_gy * dzp[k] + z_u * up_l[k] + zx * xh + z0;
        }
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) t[k] = zp[k] * sc + sh > 0 ? t[k] : 0;
        FN(pool)(t, h, w, dgp + p * mo);
    }
    FN(scratch_free)(&s);
    return 0;
}
