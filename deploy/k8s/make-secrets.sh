#!/usr/bin/env bash
# Makes deploy/k8s/secrets/ (a lockId key, the principals' tokens, TLS
# certificates for the routers and etcd), which kustomization.yaml turns into
# Secrets, and puts the token hashes into router/router.toml: run it once
# before `kubectl apply -k deploy/k8s`. See deploy/make-secrets.sh.
exec "$(dirname "$0")/../make-secrets.sh" k8s
