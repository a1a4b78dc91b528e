/* Channel counts a kernel does not take whole (ShuffleNet's 24 / 58 / 116 / 232): the call runs
 * on NHWC copies padded to whole channel groups, the packing's weights and constants there zero,
 * and the real channels are copied back. Tails inside the kernels' inner loops had cost every
 * layer (conv_gemm_int8.c: a 64-channel 1x1 30% slower, its sums spilled to memory); a copy costs
 * only the layers that need it. */
#ifndef QB_PADDED_CHANNELS_H
#define QB_PADDED_CHANNELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ``rows`` rows of ``size``-byte items, ``from`` items apart in src, ``to`` apart in dst: the
 * first min(from, to) items of each (the rest of a wider dst row is left as it is). */
static inline void copy_rows(void* dst, const void* src, size_t rows, size_t from, size_t to, size_t size) {
  const size_t bytes = (from < to ? from : to) * size;
  for (size_t r = 0; r < rows; r++) memcpy((char*)dst + r * to * size, (const char*)src + r * from * size, bytes);
}

/* A multiple of ``group`` channels at least ``channels``. */
static inline int padded_channels(int channels, int group) { return (channels + group - 1) / group * group; }

/* ``run(threads, padded_call, x, y)`` (0 or -1) on copies of x (``in_pixels`` x ``channels``
 * uint8) and y (``out_pixels`` x ``channels`` items of ``out_item`` bytes) padded to ``padded``
 * channels (``padded_call`` says so); -1 also when a copy could not be allocated. */
static inline int run_padded(int (*run)(int, const void*, const uint8_t*, void*), int threads, const void* padded_call,
                             size_t in_pixels, size_t out_pixels, int channels, int padded, const uint8_t* x, void* y,
                             size_t out_item) {
  uint8_t* x_padded = calloc(in_pixels * padded, 1);
  void* y_padded = malloc(out_pixels * padded * out_item);
  int status = -1;
  if (x_padded && y_padded) {
    copy_rows(x_padded, x, in_pixels, channels, padded, 1);
    status = run(threads, padded_call, x_padded, y_padded);
    if (!status) copy_rows(y, y_padded, out_pixels, padded, channels, out_item);
  }
  free(x_padded);
  free(y_padded);
  return status;
}

#endif
