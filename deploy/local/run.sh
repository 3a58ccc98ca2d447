#!/usr/bin/env bash
# Quick start: three single-node etcd clusters (shards a, b, c) under .local/
# and the router on 127.0.0.1:8080 with config/local.toml. Logs go to
# .local/*.log. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/../.."

state=.local
mkdir -p "$state"
pids=()
cleanup() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "stopped"
}
trap cleanup INT TERM EXIT

cargo build --release --bin lockrouter

start_etcd() { # name client_port peer_port
  local name=$1 client=http://127.0.0.1:$2 peer=http://127.0.0.1:$3
  etcd --name "$name" --data-dir "$state/etcd-$name" \
    --listen-client-urls "$client" --advertise-client-urls "$client" \
    --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "$name=$peer" >"$state/etcd-$name.log" 2>&1 &
  pids+=($!)
}
start_etcd a 12379 12380
start_etcd b 12479 12480
start_etcd c 12579 12580

for port in 12379 12479 12579; do
  for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
done
echo "etcd shards a, b, c on 127.0.0.1:12379, :12479, :12579 (logs in $state/)"

./target/release/lockrouter serve --config config/local.toml 2> >(tee "$state/router.log" >&2) &
pids+=($!)
echo "router on http://127.0.0.1:8080 (log in $state/router.log); Ctrl-C stops everything"
wait "${pids[-1]}"
