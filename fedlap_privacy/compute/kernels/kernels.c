/* The library setup.py builds at install time: gn_relu_pool.c and winograd.c once per
   scalar type (scalar_t, FN(name): name_f32 and name_f64), and the key the loader checks
   (fedlap_privacy/compute/kernels/library.py): the sources' hash and, for a -march=native
   build, the processor's. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define scalar_t float
#define FN(name) name##_f32
#include "gn_relu_pool.c"
#include "winograd.c"
#undef scalar_t
#undef FN
#define scalar_t double
#define FN(name) name##_f64
#include "gn_relu_pool.c"
#include "winograd.c"

const char *fedlap_kernels_key(void) { return FEDLAP_KERNELS_KEY; }
