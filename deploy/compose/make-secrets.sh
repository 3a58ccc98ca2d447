#!/usr/bin/env bash
# Makes deploy/compose/secrets/ (a lockId key, the principals' tokens, TLS
# certificates for the routers and etcd) and puts the token hashes into
# router.toml: run it once before `docker compose up`. See deploy/make-secrets.sh.
exec "$(dirname "$0")/../make-secrets.sh" compose
