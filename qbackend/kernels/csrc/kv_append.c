/* A KV cache append as a step of a kernel chain (qbackend/llm/kv_append.py, kernel_chain.py): the
 * new rows of [B, H, rows, D] keys or values copied into the room kept after the cache's
 * ``rows`` rows, which the chain passes per call (the room was checked before the call). */
#include <stdint.h>
#include <string.h>

#include "call_structs.h"

int qb_kv_append_call(int threads, const kv_append_call_t* c, const char* added, char* past, const void* rows, void* unused) {
  (void)threads, (void)unused; /* (a decode step adds a few KB: one thread) */
  char* room = past + (intptr_t)rows * c->past_stride[2];
  for (long b = 0; b < c->batch; b++)
    for (long h = 0; h < c->heads; h++)
      for (long r = 0; r < c->added; r++)
        memcpy(room + b * c->past_stride[0] + h * c->past_stride[1] + r * c->past_stride[2],
               added + b * c->new_stride[0] + h * c->new_stride[1] + r * c->new_stride[2], c->row_bytes);
  return 0;
}
