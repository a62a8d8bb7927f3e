# ubep-balancer (no GPU). Build from the repository root:
#   docker build -f deploy/docker/ubep-balancer.Dockerfile -t ghcr.io/ubep/ubep-balancer:0.1.0 .
# Stage 1 builds on Debian 12 with the project's own dependency script (CUDA off); stage 2 is
# Debian 12 slim with the shared libraries the balancer links, and ubepctl for operators.
FROM debian:bookworm AS build
WORKDIR /src
COPY . .
RUN scripts/install-deps.sh \
 && cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DUBEP_BUILD_TESTS=OFF -DUBEP_BUILD_BENCHMARKS=OFF \
      -DUBEP_ENABLE_CUDA=OFF \
 && cmake --build /build --target ubep_balancer ubepctl

FROM debian:bookworm-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libabsl20220623 libc-ares2 libcivetweb1 libgrpc++1.51 libgrpc29 libprometheus-cpp-core1.0 \
      libprometheus-cpp-pull1.0 libprotobuf32 libre2-9 libssl3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /build/bin/ubep-balancer /build/bin/ubepctl /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ubep-balancer"]
