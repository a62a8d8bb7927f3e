// UBEP_HD marks functions shared by host code and CUDA kernels, so both backends compute the
// same placement of every byte.
#ifndef UBEP_KERNELS_COMMON_HOST_DEVICE_H_
#define UBEP_KERNELS_COMMON_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define UBEP_HD __host__ __device__
#else
#define UBEP_HD
#endif

#endif  // UBEP_KERNELS_COMMON_HOST_DEVICE_H_
