/* A 3x3 convolution with stride 1 and zero padding (ph, pw) of an input with few channels
   (the ConvNet's first convolution, of grey or colour images), one output plane at a time:
       y[n][o][r][x] = b[o] + sum_c sum_(u,v) w[o][c][u][v] x[n][c][r + u - ph][x + v - pw],
   zero outside the map, for the (H + 2 ph - 2) x (W + 2 pw - 2) outputs. Each record's
   input planes are copied once, zero-padded, into a scratch block (a few KB: in the first-level cache); each output row then
   takes its 9 C taps from the three padded rows around it, 32 (or 16 for double) outputs
   at a time in four vector accumulators, and is written once. torch's (oneDNN's) kernel ran
   this shape at about 10 GFLOP/s, an eighth of its rate on the 128-channel convolutions: the
   product behind it is only 9 C deep. Writing the output, 128 planes per image, is most of
   the time here.
   Records lo <= n < hi are handled, so that callers can split the work between threads;
   returns 0 (1 where the scratch block cannot be allocated). Compiled by
   fedlap_privacy/compute/kernels/build.py once per scalar type (scalar_t, FN(name)), like
   gn_relu_pool.c. */

/* Record's Ci planes of H x W into the interior of pad's zero-bordered (H + 2 ph) x
   (W + 2 pw) planes (the border is written once, by calloc, and stays zero). */
static inline void FN(pad_record)(const scalar_t *restrict x, int64_t Ci, int64_t H,
                                  int64_t W, int64_t ph, int64_t pw, scalar_t *restrict pad) {
    const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw;
    for (int64_t c = 0; c < Ci; ++c)
        for (int64_t r = 0; r < H; ++r)
            memcpy(pad + (c * Hp + r + ph) * Wp + pw, x + (c * H + r) * W,
                   (size_t)W * sizeof(scalar_t));
}

int FN(conv3x3_few)(const scalar_t *restrict x, const scalar_t *restrict w,
                    const scalar_t *restrict b, int64_t Ci, int64_t Co, int64_t H, int64_t W,
                    int64_t ph, int64_t pw, int64_t lo, int64_t hi, scalar_t *restrict y) {
    typedef scalar_t vec __attribute__((vector_size(32)));
    enum { VL = 32 / sizeof(scalar_t), BLOCK = 4 * VL };
    const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw, Ho = Hp - 2, Wo = Wp - 2;
    scalar_t *pad = calloc((size_t)(Ci * Hp * Wp), sizeof(scalar_t));
    if (!pad)
        return 1;
    for (int64_t n = lo; n < hi; ++n) {
        FN(pad_record)(x + n * Ci * H * W, Ci, H, W, ph, pw, pad);
        for (int64_t o = 0; o < Co; ++o) {
            const scalar_t *restrict wo = w + o * Ci * 9;
            for (int64_t r = 0; r < Ho; ++r) {
                scalar_t *restrict row = y + ((n * Co + o) * Ho + r) * Wo;
                int64_t x0 = 0;
                for (; x0 + BLOCK <= Wo; x0 += BLOCK) {
                    vec acc[4];
                    for (int j = 0; j < 4; ++j)
                        acc[j] = (vec){0} + b[o];
                    for (int64_t c = 0; c < Ci; ++c)
                        for (int u = 0; u < 3; ++u) {
                            const scalar_t *src = pad + (c * Hp + r + u) * Wp + x0;
                            for (int v = 0; v < 3; ++v) {
                                const scalar_t k = wo[c * 9 + u * 3 + v];
                                for (int j = 0; j < 4; ++j) {
                                    vec s;
                                    memcpy(&s, src + v + j * VL, sizeof s);
                                    acc[j] += k * s;
                                }
                            }
                        }
                    memcpy(row + x0, acc, sizeof acc);
                }
                for (; x0 < Wo; ++x0) {
                    scalar_t acc = b[o];
                    for (int64_t c = 0; c < Ci; ++c)
                        for (int u = 0; u < 3; ++u)
                            for (int v = 0; v < 3; ++v)
                                acc += wo[c * 9 + u * 3 + v] * pad[(c * Hp + r + u) * Wp + x0 + v];
                    row[x0] = acc;
                }
            }
        }
    }
    free(pad);
    return 0;
}

/* The input gradient of that convolution,
       dx[n][c][r][s] (+)= sum_o sum_(u,v) w[o][c][u][v] gy[n][o][r + ph - u][s + pw - v],
   with gy zero outside its Ho x Wo = (H + 2 ph - 2) x (W + 2 pw - 2) map. Each
   output-gradient plane is copied once into a scratch block with a zero border two wide (in
   the first-level cache), and every input row gathers its 9 taps from the three rows around
   it, a vector at a time, into the record's input-gradient planes (rows rounded up to whole
   vectors), which stay in the cache across the Co output channels and are written once.
   torch's native kernel for this (oneDNN's is slower still) unfolds every record's gradient
   and makes one small matrix product per record. With add != 0 the result is added to dx
   instead of written over it (a sum of two convolutions without concatenating them).
   Records lo <= n < hi; returns 0 (1 where the scratch cannot be allocated). */
int FN(conv3x3_few_input_grad)(const scalar_t *restrict gy, const scalar_t *restrict w,
                               int64_t Ci, int64_t Co, int64_t H, int64_t W, int64_t ph,
                               int64_t pw, int64_t add, int64_t lo, int64_t hi,
                               scalar_t *restrict dx) {
    typedef scalar_t vec __attribute__((vector_size(32)));
    enum { VL = 32 / sizeof(scalar_t) };
    const int64_t Ho = H + 2 * ph - 2, Wo = W + 2 * pw - 2;
    const int64_t Wr = (W + VL - 1) / VL * VL;
    /* gy's plane at offset (2, 2); rows and columns outside it stay zero */
    const int64_t Hg = Ho + 4, Wg = Wo + 4 > Wr + pw + 2 ? Wo + 4 : Wr + pw + 2;
    scalar_t *gpad = calloc((size_t)(Hg * Wg + Ci * H * Wr), sizeof(scalar_t));
    if (!gpad)
        return 1;
    scalar_t *acc = gpad + Hg * Wg;
    for (int64_t n = lo; n < hi; ++n) {
        scalar_t *restrict dxn = dx + n * Ci * H * W;
        for (int64_t c = 0; c < Ci; ++c)
            for (int64_t r = 0; r < H; ++r) {
                scalar_t *row = acc + (c * H + r) * Wr;
                memset(row, 0, (size_t)Wr * sizeof(scalar_t));
                if (add)
                    memcpy(row, dxn + (c * H + r) * W, (size_t)W * sizeof(scalar_t));
            }
        for (int64_t o = 0; o < Co; ++o) {
            const scalar_t *restrict plane = gy + (n * Co + o) * Ho * Wo;
            for (int64_t i = 0; i < Ho; ++i)
                memcpy(gpad + (i + 2) * Wg + 2, plane + i * Wo, (size_t)Wo * sizeof(scalar_t));
            for (int64_t c = 0; c < Ci; ++c) {
                const scalar_t *restrict k = w + (o * Ci + c) * 9;
                for (int64_t r = 0; r < H; ++r) {
                    scalar_t *restrict row = acc + (c * H + r) * Wr;
                    for (int64_t x0 = 0; x0 < Wr; x0 += VL) {
                        vec a;
                        memcpy(&a, row + x0, sizeof a);
                        for (int u = 0; u < 3; ++u) {
                            const scalar_t *src = gpad + (r + ph - u + 2) * Wg + x0 + pw + 2;
                            for (int v = 0; v < 3; ++v) {
                                vec s;
                                memcpy(&s, src - v, sizeof s);
                                a += k[u * 3 + v] * s;
                            }
                        }
                        memcpy(row + x0, &a, sizeof a);
                    }
                }
            }
        }
        for (int64_t c = 0; c < Ci; ++c)
            for (int64_t r = 0; r < H; ++r)
                memcpy(dxn + (c * H + r) * W, acc + (c * H + r) * Wr,
                       (size_t)W * sizeof(scalar_t));
    }
    free(gpad);
    return 0;
}

/* Every record's own weight and bias gradients of that convolution (the per-record
   gradients DP-SGD clips),
       dw[n][o][c][u][v] = sum_(r,x) gy[n][o][r][x] xpad[n][c][r + u][x + v],
       db[n][o] = sum_(r,x) gy[n][o][r][x],
   with xpad the zero-padded input. Each record's input planes are copied once, padded,
   into scratch in the first-level cache; each output-gradient plane is then read once, a
   vector at a time, into nine independent sums per input channel (and one for the bias).
   Records lo <= n < hi; returns 0 (1 where the scratch cannot be allocated). */
int FN(conv3x3_few_weight_grads)(const scalar_t *restrict x, const scalar_t *restrict gy,
                                 int64_t Ci, int64_t Co, int64_t H, int64_t W, int64_t ph,
                                 int64_t pw, int64_t lo, int64_t hi, scalar_t *restrict dw,
                                 scalar_t *restrict db) {
    typedef scalar_t vec __attribute__((vector_size(32)));
    enum { VL = 32 / sizeof(scalar_t) };
    const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw, Ho = Hp - 2, Wo = Wp - 2;
    const int64_t Wv = Wo / VL * VL; /* the columns taken a vector at a time */
    scalar_t *pad = calloc((size_t)(Ci * Hp * Wp), sizeof(scalar_t));
    if (!pad)
        return 1;
    for (int64_t n = lo; n < hi; ++n) {
        FN(pad_record)(x + n * Ci * H * W, Ci, H, W, ph, pw, pad);
        for (int64_t o = 0; o < Co; ++o) {
            const scalar_t *restrict plane = gy + (n * Co + o) * Ho * Wo;
            vec bias = {0};
            scalar_t bias_tail = 0;
            for (int64_t c = 0; c < Ci; ++c) {
                vec s[9] = {{0}};
                scalar_t tail[9] = {0};
                for (int64_t r = 0; r < Ho; ++r) {
                    const scalar_t *restrict grow = plane + r * Wo;
                    const scalar_t *restrict prow = pad + (c * Hp + r) * Wp;
                    for (int64_t x0 = 0; x0 < Wv; x0 += VL) {
                        vec g;
                        memcpy(&g, grow + x0, sizeof g);
                        if (c == 0)
                            bias += g;
                        for (int u = 0; u < 3; ++u)
                            for (int v = 0; v < 3; ++v) {
                                vec p;
                                memcpy(&p, prow + u * Wp + x0 + v, sizeof p);
                                s[u * 3 + v] += g * p;
                            }
                    }
                    for (int64_t x1 = Wv; x1 < Wo; ++x1) {
                        if (c == 0)
                            bias_tail += grow[x1];
                        for (int u = 0; u < 3; ++u)
                            for (int v = 0; v < 3; ++v)
                                tail[u * 3 + v] += grow[x1] * prow[u * Wp + x1 + v];
                    }
                }
                scalar_t *restrict out = dw + ((n * Co + o) * Ci + c) * 9;
                for (int t = 0; t < 9; ++t) {
                    scalar_t total = tail[t];
                    for (int l = 0; l < VL; ++l)
                        total += s[t][l];
                    out[t] = total;
                }
            }
            scalar_t total = bias_tail;
            for (int l = 0; l < VL; ++l)
                total += bias[l];
            db[n * Co + o] = total;
        }
    }
    free(pad);
    return 0;
}
