#!/usr/bin/env bash
# Makes deploy/compose/secrets/ (a lockId key, the principals' tokens, TLS
# certificates for the routers and etcd) and secrets/router.toml, router.toml
# with the token hashes: run it once before `docker compose up`, and again
# after editing router.toml. See deploy/make-secrets.sh.
exec "$(dirname "$0")/../make-secrets.sh" compose
