#!/usr/bin/env bash
# Makes deploy/k8s/secrets/ (a lockId key, the principals' tokens, TLS
# certificates for the routers and etcd), which kustomization.yaml turns into
# Secrets, and secrets/router.toml, router/router.toml with the token hashes
# (the ConfigMap): run it once before `kubectl apply -k deploy/k8s`, and
# again after editing router/router.toml. See deploy/make-secrets.sh.
exec "$(dirname "$0")/../make-secrets.sh" k8s
