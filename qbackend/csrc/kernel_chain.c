/* Runs a chain of qbackend's own int8 kernels (qbackend/kernel_chain.py) in one call.
 *
 * Why: each kernel call from Python costs ~4 us besides the kernel (argument handling, the
 * output's allocation, ctypes), and a MobileNetV2 image makes 46 of them, most computing for
 * 15-60 us. A chain's steps are prepared once per input shape; its intermediates live in one
 * arena laid out by the planner, so a call is one ctypes call with the arena's, inputs' and
 * outputs' addresses.
 */
#include <stddef.h>
#include <stdint.h>

typedef struct {
  int base;    /* index into bases (the arena, the chain's inputs, its outputs); -1: no operand */
  long offset; /* bytes from it */
} operand_t;

enum kind { GEMM_CONV = 0, X_TO_Y = 1 }; /* X_TO_Y: (threads, call, x, y) -> 0 or failure */

typedef struct {
  int kind;
  const void* function; /* qb_conv_call(_vnni); X_TO_Y: qb_dwconv(_vnni)_call, qb_stem_conv_vnni_call, the pools */
  const void* call;     /* its prepared arguments */
  operand_t x, residual, y, yf; /* yf: a float32 output (GEMM_CONV only; an X_TO_Y call says its y's dtype) */
} chain_step_t;

typedef int (*gemm_conv_fn)(int, const void*, const uint8_t*, const void*, uint8_t*, float*);
typedef int (*x_to_y_fn)(int, const void*, const uint8_t*, void*);

static void* address(void* const* bases, operand_t o) { return o.base < 0 ? NULL : (char*)bases[o.base] + o.offset; }

/* 0, or the 1-based index of the step that failed (a kernel could not allocate its scratch). */
int qb_run_chain(int threads, int count, const chain_step_t* steps, void* const* bases) {
  for (int i = 0; i < count; i++) {
    const chain_step_t* s = &steps[i];
    const int failed = s->kind == GEMM_CONV
                           ? ((gemm_conv_fn)s->function)(threads, s->call, address(bases, s->x), address(bases, s->residual),
                                                         address(bases, s->y), address(bases, s->yf))
                           : ((x_to_y_fn)s->function)(threads, s->call, address(bases, s->x), address(bases, s->y));
    if (failed) return i + 1;
  }
  return 0;
}
