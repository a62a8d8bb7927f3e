// CopyNow: a host-side copy done before it returns, on a stream the caller names. Never on the
// legacy default stream (cudaMemcpy): that one waits for every blocking stream of the context,
// the streams of other ranks of this process on the device among them, whose kernels may be
// waiting for the very rank making the copy (a deadlock until their timeout).
#ifndef UBEP_KERNELS_CUDA_COPY_NOW_H_
#define UBEP_KERNELS_CUDA_COPY_NOW_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ubep::kernels {

inline cudaError_t CopyNow(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                           cudaStream_t stream) {
  if (const cudaError_t e = cudaMemcpyAsync(to, from, bytes, kind, stream); e != cudaSuccess) {
    return e;
  }
  return cudaStreamSynchronize(stream);
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_CUDA_COPY_NOW_H_
