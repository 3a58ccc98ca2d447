#!/usr/bin/env bash
# Quick start: three single-node etcd clusters (shards a, b, c) under .local/
# and the router on 127.0.0.1:8080 with config/local.toml. Logs go to
# .local/*.log. Ctrl-C stops everything.
#
#   run.sh          config/local.toml as it is (`make run`)
#   run.sh --auth   with auth on (`make run-auth`): a lockId key and the bearer
#                   token of one admin principal, "local", made once under
#                   .local/auth/ (mode 0600) and kept between runs, and the
#                   router started with .local/router-auth.toml, written at
#                   each run as config/local.toml plus an [auth] section.
set -euo pipefail
cd "$(dirname "$0")/../.."

auth=0
for arg in "$@"; do
  case $arg in
    --auth) auth=1 ;;
    *)
      echo "usage: $0 [--auth]" >&2
      exit 2
      ;;
  esac
done

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
bin=./target/release/lockrouter
config=config/local.toml

# The [auth] setup of `run.sh --auth`: makes what is missing under
# .local/auth/ (through temporary files, so that an interrupted run leaves no
# partial secret behind) and writes the config; sets $config and $token.
setup_auth() {
  local dir=$state/auth hash
  (umask 077 && mkdir -p "$dir")
  chmod 700 "$dir"
  if [[ ! -s $dir/lockid-key ]]; then
    (umask 077 && "$bin" auth new-key >"$dir/lockid-key.tmp")
    mv "$dir/lockid-key.tmp" "$dir/lockid-key"
    echo "made a lockId key: $dir/lockid-key"
  fi
  if [[ ! -s $dir/token || ! -s $dir/token.sha256 ]]; then
    # `auth new-token` prints `token = ...` and `token_sha256 = ["..."]`.
    local made
    made=$("$bin" auth new-token)
    token=$(sed -n 's/^token = //p' <<<"$made")
    hash=$(sed -n 's/^token_sha256 = .*\([0-9a-f]\{64\}\).*$/\1/p' <<<"$made")
    if [[ -z $token || ! $hash =~ ^[0-9a-f]{64}$ ]]; then
      echo "'lockrouter auth new-token' printed no token and hash" >&2
      exit 1
    fi
    (umask 077 && echo "$hash" >"$dir/token.sha256.tmp" && echo "$token" >"$dir/token.tmp")
    mv "$dir/token.sha256.tmp" "$dir/token.sha256"
    mv "$dir/token.tmp" "$dir/token"
    echo "made the admin token: $dir/token"
  fi
  chmod 600 "$dir/lockid-key" "$dir/token" "$dir/token.sha256"
  token=$(<"$dir/token")
  hash=$(<"$dir/token.sha256")
  if [[ -z $token || ! $hash =~ ^[0-9a-f]{64}$ ]]; then
    echo "$dir/token or $dir/token.sha256 is damaged: delete both and run again" >&2
    exit 1
  fi
  config=$state/router-auth.toml
  local key_file
  key_file="$(pwd)/$dir/lockid-key"
  key_file=${key_file//\\/\\\\}
  key_file=${key_file//\"/\\\"}
  {
    echo "# Written by deploy/local/run.sh --auth at each run: config/local.toml"
    echo "# and the [auth] section below. Edit config/local.toml, not this file."
    echo
    cat config/local.toml
    cat <<TOML

[auth]
# The key lockIds are sealed with (deploy/local/run.sh made it once).
[[auth.lock_id_keys]]
id = "local"
secret_file = "$key_file"

# The one caller: every name, and the admin routes. Its token is in
# $dir/token; the config holds only its SHA-256.
[[auth.principals]]
name = "local"
token_sha256 = ["$hash"]
name_prefixes = [""]
admin = true
TOML
  } >"$config.tmp"
  mv "$config.tmp" "$config"
}
if [[ $auth == 1 ]]; then setup_auth; fi

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

# tee ignores Ctrl-C and SIGTERM and ends when the router closes its stderr:
# a router whose log pipe broke first would not drain and exit.
"$bin" serve --config "$config" 2> >(trap '' INT TERM && exec tee "$state/router.log" >&2) &
pids+=($!)
router=${pids[-1]}

# The address is printed once the router can serve (/readyz answers 200:
# it has confirmed its ring on the shards), not before; a router that
# exits meanwhile (a port in use, say) ends the run.
url=http://127.0.0.1:8080
ready=0
for _ in $(seq 1 150); do
  if curl -fsS "$url/readyz" >/dev/null 2>&1; then
    ready=1
    break
  fi
  if ! kill -0 "$router" 2>/dev/null; then
    echo "the router exited before it was ready (log in $state/router.log)" >&2
    exit 1
  fi
  sleep 0.2
done
if [[ $ready == 1 ]]; then
  echo "router on $url, ready (log in $state/router.log); Ctrl-C stops everything"
else
  echo "router on $url is not ready after 30 s: 'curl -s $url/readyz' says why (log in $state/router.log)"
fi
echo "status page: $url/ui"
if [[ $auth == 1 ]]; then
  cat <<EOT
auth is on ($config): every lock API call needs the bearer token of principal
"local" (every name, and the admin routes), kept in $state/auth/token:
  export LOCKROUTER_TOKEN=$token
  curl -s -X POST http://127.0.0.1:8080/api/v1/locks/acquire \\
    -H "Authorization: Bearer \$LOCKROUTER_TOKEN" -H 'Content-Type: application/json' \\
    -d '{"name":"process_order:42","ttlMs":30000,"clientId":"worker-7-3f1c9a"}'
EOT
fi
wait "${pids[-1]}"
