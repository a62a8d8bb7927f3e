# ubepd with the CUDA backend. Build from the repository root:
#   docker build -f deploy/docker/ubepd.Dockerfile -t ghcr.io/ubep/ubepd:0.1.0 .
# Stage 1 builds on Debian 12 with the project's own dependency script and NVIDIA's CUDA 13
# toolkit and NCCL for Debian 12; stage 2 is Debian 12 slim with the shared libraries ubepd links
# (the CUDA driver comes from the node, through the NVIDIA container runtime).
FROM debian:bookworm AS build
# NCCL as the project builds and tests it (nccl.h 2.28.9 under /usr/local/cuda); NVIDIA's
# repository keeps older versions, so the image does not change under a rebuild.
ARG NCCL_VERSION=2.28.9-1+cuda13.0
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates wget \
 && wget -q https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
 && dpkg -i cuda-keyring_1.1-1_all.deb && rm cuda-keyring_1.1-1_all.deb \
 && apt-get update -qq && apt-get install -y -qq --no-install-recommends cuda-toolkit-13-0 libnccl2=${NCCL_VERSION} libnccl-dev=${NCCL_VERSION} \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/cuda/bin:$PATH
WORKDIR /src
COPY . .
RUN scripts/install-deps.sh \
 && cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DUBEP_BUILD_TESTS=OFF -DUBEP_BUILD_BENCHMARKS=OFF \
      -DUBEP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="90;100" \
 && cmake --build /build --target ubepd

FROM debian:bookworm-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libabsl20220623 libc-ares2 libcivetweb1 libgrpc++1.51 libgrpc29 libprometheus-cpp-core1.0 \
      libprometheus-cpp-pull1.0 libprotobuf32 libre2-9 libssl3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /build/bin/ubepd /usr/local/bin/ubepd
COPY --from=build /usr/local/cuda/lib64/libcudart.so.13* /usr/local/lib/
# NCCL: the links that copy expert weights between load/store domains.
COPY --from=build /usr/lib/x86_64-linux-gnu/libnccl.so.2* /usr/local/lib/
RUN ldconfig
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ubepd"]
