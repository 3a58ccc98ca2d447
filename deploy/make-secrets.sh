#!/usr/bin/env bash
# Makes the secrets the Compose stack or the Kubernetes manifests start with,
# and the router config they serve: that layout's tracked router.toml with
# the principals' token hashes filled in, written to secrets/router.toml
# (git-ignored, like everything it makes: the tracked files stay as they
# are):
#
#   deploy/make-secrets.sh compose   # deploy/compose/secrets/ from deploy/compose/router.toml
#   deploy/make-secrets.sh k8s       # deploy/k8s/secrets/ from deploy/k8s/router/router.toml
#
# (deploy/compose/make-secrets.sh and deploy/k8s/make-secrets.sh run this.)
# Without these files the stack does not start: compose.yaml and
# kustomization.yaml name them. A secret that exists is kept, so running it
# again changes nothing but secrets/router.toml, which it writes anew from
# the tracked router.toml each time: edit the tracked file, then run this
# again. Delete a secret and run it again to make that one anew (a
# certificate after adding an etcd endpoint or a router name, say).
#
#   router.toml               the router config the routers read (mode 0644:
#                             it holds token hashes, not tokens)
#   lockid-k1                 the lockId key of [[auth.lock_id_keys]] "k1"
#                             (`lockrouter auth new-key`)
#   token-payments, token-ops bearer tokens of the principals "payments" (an
#                             example tenant) and "ops" (admin); their SHA-256
#                             go into the router config (`lockrouter auth new-token`)
#   ca.pem                    the CA of the routers' certificate: what clients trust
#   router.pem, router-key.pem          the routers' certificate (TLS on their listener)
#   etcd-ca.pem               the CA of the etcd members and of the routers'
#                             client certificate for etcd
#   etcd.pem, etcd-key.pem    the etcd members' certificate: every host of an
#                             https:// endpoint in the router config, localhost
#   etcd-client.pem, etcd-client-key.pem  the routers' client certificate for etcd
#   ca-key.pem, etcd-ca-key.pem         the CAs' keys: nothing mounts them
#
# The directory is mode 0700, certificates 0644, keys and tokens 0600 except,
# for Compose, the keys containers read: Compose bind-mounts file secrets
# with their host owner and mode, and the router runs as a non-root user of
# its own, so those are 0644 too (still inside the 0700 directory).
#
# Needs openssl, and lockrouter: $LOCKROUTER_BIN, else target/release or
# target/debug's, else the image $LOCKROUTER_IMAGE (default lockrouter:local,
# which `docker compose -f deploy/compose/compose.yaml build` makes) run with
# docker. Settings, from the environment:
#   ROUTER_NAMES        more names or IP addresses for the routers'
#                       certificate, comma-separated (the name clients use)
#   K8S_NAMESPACE       the manifests' namespace (lockrouter)
#   K8S_CLUSTER_DOMAIN  the cluster's DNS domain (cluster.local)
#   CERT_DAYS           how long new certificates are valid (825)
set -euo pipefail

layout=${1:-}
deploy=$(cd "$(dirname "$0")" && pwd)
case $layout in
  compose) template=$deploy/compose/router.toml dir=$deploy/compose/secrets ;;
  k8s) template=$deploy/k8s/router/router.toml dir=$deploy/k8s/secrets ;;
  *)
    echo "usage: $0 compose|k8s" >&2
    exit 2
    ;;
esac
config=$dir/router.toml
namespace=${K8S_NAMESPACE:-lockrouter}
domain=${K8S_CLUSTER_DOMAIN:-cluster.local}
days=${CERT_DAYS:-825}
image=${LOCKROUTER_IMAGE:-lockrouter:local}
# The principals of the shipped configs, and what their placeholders are: no
# token has a hash of 62 zeros and two digits, so until this script has run
# every call is refused.
principals=(payments ops)
zeros=$(printf '0%.0s' {1..62})

die() {
  echo "make-secrets: $*" >&2
  exit 1
}
command -v openssl >/dev/null || die "needs openssl"

# `lockrouter ARGS...`, from a binary or the image.
if [[ -n ${LOCKROUTER_BIN:-} ]]; then
  bin=$LOCKROUTER_BIN
elif [[ -x $deploy/../target/release/lockrouter ]]; then
  bin=$deploy/../target/release/lockrouter
elif [[ -x $deploy/../target/debug/lockrouter ]]; then
  bin=$deploy/../target/debug/lockrouter
elif command -v docker >/dev/null && docker image inspect "$image" >/dev/null 2>&1; then
  bin=""
else
  die "needs lockrouter: set LOCKROUTER_BIN, run 'cargo build --release --bin lockrouter', or build the image ($image)"
fi
lockrouter() {
  if [[ -n $bin ]]; then
    "$bin" "$@"
  else
    docker run --rm "$image" "$@"
  fi
}
check_config() {
  if [[ -n $bin ]]; then
    "$bin" config check --config "$config"
  else
    docker run --rm -v "$config:/etc/lockrouter/router.toml:ro" "$image" \
      config check --config /etc/lockrouter/router.toml
  fi
}

(umask 077 && mkdir -p "$dir")
chmod 700 "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
umask 077

# Moves $tmp/$1 to $dir/$1 (new files appear whole or not at all).
keep() { mv "$tmp/$1" "$dir/$1"; }
made=()

if [[ ! -s $dir/lockid-k1 ]]; then
  lockrouter auth new-key >"$tmp/lockid-k1"
  grep -Eq '^[A-Za-z0-9+/]{43}=$' "$tmp/lockid-k1" || die "'lockrouter auth new-key' printed no key"
  keep lockid-k1
  made+=(lockid-k1)
fi
for p in "${principals[@]}"; do
  [[ -s $dir/token-$p ]] && continue
  lockrouter auth new-token | sed -n 's/^token = //p' >"$tmp/token-$p"
  [[ -s $tmp/token-$p ]] || die "'lockrouter auth new-token' printed no token"
  keep "token-$p"
  made+=("token-$p")
done

# Certificates: P-256 keys; CAs valid for ten years, the rest for $days days.
cat >"$tmp/openssl.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = lockrouter
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
EOF
new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
new_ca() { # file common-name
  [[ -s $dir/$1.pem && -s $dir/$1-key.pem ]] && return 0
  new_key "$tmp/$1-key.pem"
  openssl req -x509 -new -config "$tmp/openssl.cnf" -extensions ca -subj "/CN=$2" \
    -key "$tmp/$1-key.pem" -days 3650 -out "$tmp/$1.pem"
  keep "$1-key.pem"
  keep "$1.pem"
  made+=("$1.pem")
}
new_leaf() { # file ca common-name extended-key-usage subject-alt-names
  [[ -s $dir/$1.pem && -s $dir/$1-key.pem ]] && return 0
  new_key "$tmp/$1-key.pem"
  {
    echo "[leaf]"
    echo "basicConstraints = critical,CA:FALSE"
    echo "keyUsage = critical,digitalSignature"
    echo "extendedKeyUsage = $4"
    echo "subjectKeyIdentifier = hash"
    echo "authorityKeyIdentifier = keyid"
    if [[ -n $5 ]]; then echo "subjectAltName = $5"; fi
  } >"$tmp/$1.ext"
  openssl req -new -config "$tmp/openssl.cnf" -subj "/CN=$3" \
    -key "$tmp/$1-key.pem" -out "$tmp/$1.csr"
  openssl x509 -req -in "$tmp/$1.csr" -CA "$dir/$2.pem" -CAkey "$dir/$2-key.pem" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" \
    -extfile "$tmp/$1.ext" -extensions leaf -out "$tmp/$1.pem" 2>/dev/null
  keep "$1-key.pem"
  keep "$1.pem"
  made+=("$1.pem")
}
# "a,b,10.0.0.1" -> "DNS:a,DNS:b,IP:10.0.0.1"
alt_names() {
  local out="" n
  while read -r n; do
    if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then out+=",IP:$n"; else out+=",DNS:$n"; fi
  done < <(tr ', ' '\n\n' <<<"$1" | sed '/^$/d' | sort -u)
  echo "${out#,}"
}

case $layout in
  compose) router_names="localhost,127.0.0.1,::1,router-1,router-2,lb" ;;
  k8s)
    router_names="localhost,127.0.0.1,lockrouter,lockrouter.$namespace"
    router_names+=",lockrouter.$namespace.svc,lockrouter.$namespace.svc.$domain"
    ;;
esac
router_names+=",${ROUTER_NAMES:-}"
# The hosts of the https:// shard endpoints; on Kubernetes also their names
# in the namespace's service domain, which the members advertise.
etcd_hosts=$(grep -Eo 'https://[^:/"]+' "$template" | sed 's|^https://||' | sort -u)
[[ -n $etcd_hosts ]] || die "$template has no https:// shard endpoints"
etcd_names="localhost,127.0.0.1"
for h in $etcd_hosts; do
  etcd_names+=",$h"
  if [[ $layout == k8s ]]; then etcd_names+=",$h.$namespace.svc,$h.$namespace.svc.$domain"; fi
done

new_ca ca "lockrouter router CA"
new_leaf router ca lockrouter serverAuth "$(alt_names "$router_names")"
new_ca etcd-ca "lockrouter etcd CA"
# Also a client certificate: etcd dials its own gRPC server with it for its
# HTTP gateway, and the health checks run etcdctl with it.
new_leaf etcd etcd-ca etcd serverAuth,clientAuth "$(alt_names "$etcd_names")"
# etcd takes the common name for the user when its auth is on.
new_leaf etcd-client etcd-ca lockrouter clientAuth ""

find "$dir" -maxdepth 1 -type f ! -name router.toml -exec chmod 600 {} +
chmod 644 "$dir"/{ca,router,etcd-ca,etcd,etcd-client}.pem
if [[ $layout == compose ]]; then
  chmod 644 "$dir"/{lockid-k1,router-key.pem,etcd-key.pem,etcd-client-key.pem}
fi

# secrets/router.toml: the tracked config, each principal's token_sha256
# placeholder turned into the hash of its token file. A list that already
# holds that hash is left as it is, and so is any other list (a rotation in
# progress, or a token made anew), which is reported.
hash_of() { # token file -> the hex SHA-256 of its one line, as the router hashes it
  printf '%s' "$(head -n 1 "$1")" | openssl dgst -sha256 -r | cut -d' ' -f1
}
fill() { # principal hash: $tmp/router.toml -> $tmp/router.next
  awk -v who="$1" -v hash="$2" -v zeros="$zeros" '
    /^\[/ { in_p = ($0 ~ /^\[\[auth\.principals\]\]/); name = "" }
    in_p && /^name = / { name = $3; gsub(/"/, "", name) }
    in_p && name == who && /^token_sha256 = / {
      found = 1
      placeholder = index($0, "token_sha256 = [\"" zeros) == 1 && $0 ~ /^token_sha256 = \["[0-9a-f]+"\]$/
      if (index($0, hash)) { state = "kept" }
      else if (placeholder) { $0 = "token_sha256 = [\"" hash "\"]"; state = "filled" }
      else { state = "other" }
    }
    { print }
    END { print (found ? state : "missing") > "/dev/stderr" }
  ' "$tmp/router.toml" >"$tmp/router.next" 2>"$tmp/state"
  mv "$tmp/router.next" "$tmp/router.toml"
  cat "$tmp/state"
}
cp "$template" "$tmp/router.toml"
problems=0
for p in "${principals[@]}"; do
  hash=$(hash_of "$dir/token-$p")
  state=$(fill "$p" "$hash")
  case $state in
    filled | kept) ;;
    other)
      echo "make-secrets: $template: token_sha256 of \"$p\" does not hold the hash of secrets/token-$p ($hash): add it by hand (keep an old hash in the list while its clients move over)" >&2
      problems=1
      ;;
    *)
      echo "make-secrets: $template has no principal \"$p\" with a token_sha256 line" >&2
      problems=1
      ;;
  esac
done

if ! cmp -s "$tmp/router.toml" "$config"; then
  # In place (the same file): Compose bind-mounts it, and a running router
  # reloads it when it changes.
  cat "$tmp/router.toml" >"$config"
  echo "wrote $config: $template with the principals' token hashes"
fi
chmod 644 "$config"
for f in "${made[@]}"; do echo "made $dir/$f"; done
# Its summary line goes to stderr (stdout is the effective settings, JSON).
check_config 2>"$tmp/check" >/dev/null || {
  cat "$tmp/check" >&2
  die "lockrouter config check refuses $config"
}
cat "$tmp/check"
[[ $problems == 0 ]] || exit 1

case $layout in
  compose)
    cat <<EOF
Start the stack:  docker compose -f deploy/compose/compose.yaml up --build
Then, through nginx on https://localhost:8080 (clients trust secrets/ca.pem):
  curl --cacert deploy/compose/secrets/ca.pem https://localhost:8080/readyz
  curl --cacert deploy/compose/secrets/ca.pem -X POST https://localhost:8080/api/v1/locks/acquire \\
    -H "Authorization: Bearer \$(cat deploy/compose/secrets/token-payments)" \\
    -H 'Content-Type: application/json' \\
    -d '{"name":"payments/order-42","ttlMs":30000,"clientId":"payments-worker-1"}'
EOF
    ;;
  k8s)
    cat <<EOF
Apply the manifests:  kubectl apply -k deploy/k8s
Clients reach https://lockrouter.$namespace.svc:8080 and trust deploy/k8s/secrets/ca.pem;
give each tenant's workers its token (deploy/k8s/secrets/token-*).
EOF
    ;;
esac
