#!/usr/bin/env bash
# Installs what building and testing lockrouter needs, if missing: etcd
# (Debian's etcd-server, 3.4.x) and protoc (protobuf-compiler, for
# etcd-client's build), and prometheus with promtool (Debian's prometheus,
# for the dashboard tests). Uses sudo when not root. Fails loudly otherwise.
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)

if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "lockrouter needs: ${need[*]} (etcd 3.4.x or >= 3.5.3, and protoc); install them with your package manager" >&2
    exit 1
  fi
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "installing ${need[*]} needs root or sudo" >&2; exit 1; }
    sudo="sudo"
  fi
  echo "installing ${need[*]} ..." >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian's prometheus package enables a service listening on :9090. The
  # tests start their own servers on free ports and never use it; stop the
  # one we just installed so it does not scrape or hold the port.
  if [[ " ${need[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

command -v etcd >/dev/null 2>&1 || { echo "etcd is still missing after install" >&2; exit 1; }
command -v protoc >/dev/null 2>&1 || { echo "protoc is still missing after install" >&2; exit 1; }
command -v promtool >/dev/null 2>&1 || { echo "prometheus (promtool) is still missing after install" >&2; exit 1; }
command -v cargo >/dev/null 2>&1 || { echo "cargo is missing: install Rust (https://rustup.rs)" >&2; exit 1; }
