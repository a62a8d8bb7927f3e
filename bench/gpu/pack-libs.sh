# Sourced by pack.sh and run.sh: which shared libraries a GPU machine brings itself (the C
# library and its loader, the CUDA driver, NCCL), and which the pack keeps in lib-compat/
# for a machine whose own are older than the build's (libstdc++, libgcc_s). Every other
# library a packed binary loads travels in the pack's lib/.
# shellcheck shell=bash
pack_system_libs='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libcuda\.|libnccl\.)'
pack_compat_libs='^(libstdc\+\+|libgcc_s)\.'
