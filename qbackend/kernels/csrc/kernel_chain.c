/* Runs a chain of qbackend's own kernels (qbackend/kernels/kernel_chain.py) in one call.
 *
 * Why: each kernel call from Python costs ~4 us besides the kernel (argument handling, the
 * output's allocation, ctypes), and a MobileNetV2 image makes 46 of them, most computing for
 * 15-60 us; a Llama decode step makes ~70 small float and weight-only calls with views between.
 * A chain's steps are prepared once per input shape; its intermediates live in one
 * arena laid out by the planner, so a call is one ctypes call with the arena's, inputs' and
 * outputs' addresses.
 */
#include <stddef.h>
#include <stdint.h>

#include "call_structs.h"

/* FOUR: (threads, call, a, b, c, d) -> 0 or failure; X_TO_Y: (threads, call, x, y); SIX: (threads, call, a .. f);
 * LIST: (threads, call, bases, a), a call whose operands are more than six (its call lists them) */
enum kind { FOUR = 0, X_TO_Y = 1, SIX = 2, LIST = 3 };

typedef int (*four_fn)(int, const void*, void*, void*, void*, void*);
typedef int (*x_to_y_fn)(int, const void*, const void*, void*);
typedef int (*six_fn)(int, const void*, void*, void*, void*, void*, void*, void*);
typedef int (*list_fn)(int, const void*, void* const*, void*);

/* 0; the 1-based index of the step that failed (a kernel could not allocate its scratch); or minus
 * that index where the step refused this call's values (QB_STEP_REFUSED). */
int qb_run_chain(int threads, int count, const chain_step_t* steps, void* const* bases) {
  for (int i = 0; i < count; i++) {
    const chain_step_t* s = &steps[i];
#define AT(o) operand_address(bases, s->o)
    void *a = AT(a), *b = AT(b);
    const int failed = s->kind == X_TO_Y ? ((x_to_y_fn)s->function)(threads, s->call, a, b)
                       : s->kind == LIST ? ((list_fn)s->function)(threads, s->call, bases, a)
                       : s->kind == FOUR ? ((four_fn)s->function)(threads, s->call, a, b, AT(c), AT(d))
                                         : ((six_fn)s->function)(threads, s->call, a, b, AT(c), AT(d), AT(e), AT(f));
#undef AT
    if (failed) return failed == QB_STEP_REFUSED ? -(i + 1) : i + 1;
  }
  return 0;
}
