# syntax=docker/dockerfile:1
# The lockrouter router image: built in a full Rust image, run from a small
# distroless one as a non-root user. Build from the repository root:
#   docker build -t lockrouter .
# Run: docker run -v $PWD/config/example.toml:/etc/lockrouter/router.toml lockrouter
# (the default command serves /etc/lockrouter/router.toml).

FROM rust:1.85-bookworm AS build
# etcd-client's build generates its gRPC code with protoc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts keep the registry and build outputs between builds; the
# binary is copied out because the target directory is not in the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --bin lockrouter \
 && cp target/release/lockrouter /lockrouter

# glibc and libgcc, nothing else: no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /lockrouter /usr/local/bin/lockrouter
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/lockrouter"]
CMD ["serve", "--config", "/etc/lockrouter/router.toml"]
