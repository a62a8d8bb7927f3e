# Build knobs, declared once with their defaults.
option(UBEP_BUILD_TESTS "Build the test suite" ON)
option(UBEP_BUILD_BENCHMARKS "Build the benchmark binaries" ON)
set(UBEP_SANITIZE "" CACHE STRING "Sanitizers: '', 'address' (ASan+UBSan) or 'thread' (TSan)")
set_property(CACHE UBEP_SANITIZE PROPERTY STRINGS "" address thread)
# libubep.so: the C ABI as a shared library, for FFI (Python's ctypes or cffi, Rust). Not with
# sanitizers: an instrumented library cannot be loaded into an uninstrumented interpreter.
if(UBEP_SANITIZE STREQUAL "")
  set(_ubep_shared_default ON)
else()
  set(_ubep_shared_default OFF)
endif()
option(UBEP_BUILD_SHARED_CLIENT "Build libubep.so (the C ABI for FFI)" ${_ubep_shared_default})
# The x86-64 level of the host kernels (the host backend's row loops) and the bench's MPI
# baseline: x86-64-v3 (AVX2, FMA: every x86-64 server of the last decade) by default. ubepd and
# libubep refuse to start on a CPU below it (kernels/common/host_cpu.h) rather than die of
# SIGILL. Ignored where the target is not x86-64.
set(UBEP_HOST_MARCH "x86-64-v3" CACHE STRING "x86-64 level of the host kernels: x86-64, x86-64-v2, x86-64-v3 or x86-64-v4")
set_property(CACHE UBEP_HOST_MARCH PROPERTY STRINGS x86-64 x86-64-v2 x86-64-v3 x86-64-v4)
if(NOT UBEP_HOST_MARCH MATCHES "^x86-64(-v[234])?$")
  message(FATAL_ERROR "UBEP_HOST_MARCH=${UBEP_HOST_MARCH}: expected x86-64, x86-64-v2, x86-64-v3 or x86-64-v4")
endif()

# CUDA is on by default when an nvcc of CUDA 12.8 or later is found (the first to build
# sm_100 and take -std=c++20 as used below; CUDA 13 lives under /usr/local/cuda here). An
# older one leaves it off, said, rather than fail the build of a project that needs no GPU.
if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
include(CheckLanguage)
check_language(CUDA)
set(_ubep_cuda_default OFF)
if(CMAKE_CUDA_COMPILER)
  execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --version OUTPUT_VARIABLE _ubep_nvcc_version
                  ERROR_QUIET)
  string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _ubep_nvcc_release "${_ubep_nvcc_version}")
  if(CMAKE_MATCH_1 AND CMAKE_MATCH_1 VERSION_GREATER_EQUAL 12.8)
    set(_ubep_cuda_default ON)
  else()
    message(STATUS "UBEP: ${CMAKE_CUDA_COMPILER} is CUDA '${CMAKE_MATCH_1}', older than 12.8 "
                   "(or not read): the CUDA backend is off unless -DUBEP_ENABLE_CUDA=ON")
  endif()
endif()
option(UBEP_ENABLE_CUDA "Build the CUDA backend (needs nvcc; runs only where a GPU is present)"
       ${_ubep_cuda_default})
if(UBEP_ENABLE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90 100)
  endif()
  # CMake 3.25 does not know nvcc 13's C++20 dialect flag; pass it directly, and tell CMake
  # so that targets whose dependencies require cuda_std_20 still generate.
  string(APPEND CMAKE_CUDA_FLAGS " -std=c++20")
  enable_language(CUDA)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "")
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "UBEP: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
  # NCCL (ubepd's links for expert-weight copies between domains), where the toolkit has it.
  find_path(UBEP_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(UBEP_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(UBEP_NCCL_INCLUDE_DIR AND UBEP_NCCL_LIBRARY)
    set(UBEP_HAVE_NCCL ON)
    message(STATUS "UBEP: NCCL ${UBEP_NCCL_LIBRARY}")
  else()
    set(UBEP_HAVE_NCCL OFF)
    message(STATUS "UBEP: NCCL not found: weights of other domains go through ReadWeights only")
  endif()
else()
  message(STATUS "UBEP: CUDA backend OFF")
endif()

find_program(UBEP_CCACHE ccache)
if(UBEP_CCACHE)
  # One cache for every tree and every clone (scripts/build.sh sets CCACHE_DIR, and
  # CCACHE_BASEDIR / CCACHE_NOHASHDIR so that a clone elsewhere hits what this one built).
  set(CMAKE_CXX_COMPILER_LAUNCHER ${UBEP_CCACHE})
  set(CMAKE_C_COMPILER_LAUNCHER ${UBEP_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${UBEP_CCACHE})
endif()

if(UBEP_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(UBEP_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT UBEP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "UBEP_SANITIZE must be '', 'address' or 'thread', not '${UBEP_SANITIZE}'")
endif()
