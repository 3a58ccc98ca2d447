#!/usr/bin/env bash
# Checks that this machine has what a make target needs, and installs what is
# missing from Debian/Ubuntu packages (with sudo when not root).
#
#   prereqs.sh [--check] build|run|bench|test     (default: test)
#
#   build  cargo; a C compiler that compiles and links (gcc, libc6-dev: rustc
#          links with `cc`, and ring, aws-lc-sys and the tests' bundled SQLite
#          compile C) and make (jemalloc, the router's allocator, is built
#          from source with it); protoc with the well-known google/protobuf/*.proto
#          files (protobuf-compiler, libprotobuf-dev: etcd-client's build
#          compiles its .proto files, which import descriptor.proto and
#          struct.proto). Used by `make build` and `make lint`.
#   run    build + the `etcd` on PATH, which `make run` starts (etcd-server).
#   bench  build + /usr/bin/etcd or /usr/local/bin/etcd, which the load tests
#          start (etcd-server); and etcd 3.5 (>= 3.5.13) in .prereqs/etcd-3.5/,
#          beside the system's etcd, never replacing it: `make test` runs
#          the safety tests a second time on it (make test-etcd35), and the
#          load tests and the torture test can run on it through
#          LOCKROUTER_ETCD_BIN. It is fetched from Debian 13 (trixie), whose
#          etcd-server 3.5.16 needs only libc6 >= 2.34 and adduser: trixie
#          is added as an apt source on the mirror this system already uses
#          (sources.list.d/lockrouter-trixie.list), pinned at priority 1 in
#          preferences.d/lockrouter-trixie so that nothing is ever upgraded
#          or installed from it unasked; then `apt-get download` fetches
#          etcd-server and etcd-client (etcdctl of the same release, for the
#          snapshot restore test) and `dpkg-deb -x` unpacks them there.
#          Nothing is installed into the system by it.
#   test   bench + prometheus and promtool, for the dashboard tests
#          (prometheus); etcdctl of etcd's own version, for the snapshot
#          restore test (etcd-client); iproute2's `ip` able to make a network
#          namespace with a bridge and a veth pair, for the partition tests
#          (iproute2; they also need root); python3 >= 3.11 able to make a
#          venv with pip, for the Python SDK's tests and the API fuzzer
#          (python3 python3-venv python3-pip: make test-python builds
#          target/python-venv, make test-api-fuzz target/api-fuzz-venv, with
#          schemathesis from PyPI; the fuzzer starts the etcd above); node >= 20
#          with npm, for the TypeScript SDK's tests (nodejs npm: make
#          test-typescript runs npm ci and npm test); chromium able to load
#          a page headless, and a chromedriver of the same major version,
#          for the status page's browser test (chromium chromium-driver).
#
# Every check runs what the build or the tests will run (protoc compiles a
# .proto importing the well-known types, cc builds and runs a C program, etcd
# reports its version) rather than looking for a binary's name: a protoc
# without its include files, or an etcd of an unsafe version, passes a name
# check and fails later, or worse, does not fail.
#
# With --check nothing is installed: each missing or unusable item is
# reported and the exit status is 1. Otherwise the packages of the failing
# checks are installed with apt-get and everything is checked again.
set -euo pipefail

usage() {
  echo "usage: $0 [--check] build|run|bench|test" >&2
  exit 2
}

check_only=0
mode=""
for arg in "$@"; do
  case $arg in
    --check | check) check_only=1 ;;
    build | run | bench | test)
      [ -z "$mode" ] || usage
      mode=$arg
      ;;
    *) usage ;;
  esac
done
mode=${mode:-test}

case $mode in
  build) checks=(check_cargo check_cc check_protoc) ;;
  run) checks=(check_cargo check_cc check_protoc check_etcd_on_path) ;;
  bench) checks=(check_cargo check_cc check_protoc check_etcd_for_tests check_etcd35) ;;
  test) checks=(check_cargo check_cc check_protoc check_etcd_for_tests check_etcd35 check_prometheus check_etcdctl check_netns check_python check_node check_chromium) ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

problems=() # one message per missing or unusable item
need=()     # Debian packages that may fix them
fixes=()    # other steps that may fix them (functions below)
warnings=() # usable, but the operator should know

# Where etcd 3.5 is unpacked (git-ignored), and apt's configuration dir.
# Both can be moved, for prereqs-selftest.sh only.
prereqs_dir=${LOCKROUTER_PREREQS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/.prereqs}
etcd35_dir=$prereqs_dir/etcd-3.5
apt_etc=${LOCKROUTER_PREREQS_APT_ETC:-/etc/apt}

fix() { # function: a step beside apt-get install that may fix a problem
  [[ " ${fixes[*]} " == *" $1 "* ]] || fixes+=("$1")
}

fail() { # message [debian-package...]
  local msg=$1
  shift
  [ $# -eq 0 ] || msg+=" [Debian: $*]"
  problems+=("$msg")
  need+=("$@")
}

indent() { printf '    %s' "${1//$'\n'/$'\n'    }"; }

check_cargo() {
  local out
  if ! command -v cargo >/dev/null 2>&1; then
    fail "cargo is missing: install Rust with rustup (https://rustup.rs)"
  elif ! out=$(cargo --version 2>&1); then
    fail "cargo --version fails (install a stable toolchain with rustup, https://rustup.rs):
$(indent "$out")"
  fi
}

# rustc links every binary with `cc`, and the cc crate (ring, aws-lc-sys,
# rusqlite's bundled SQLite) compiles C with it, so compile and link a C
# program that uses libc's headers, and run it. The router's allocator,
# jemalloc, is built from source by its crate's build script, which runs
# `sh ./configure` and `make`.
check_cc() {
  local out
  if ! make --version >/dev/null 2>&1; then
    fail "make missing or unusable: \`make --version\` fails (jemalloc's build runs it)" make
  fi
  if ! command -v cc >/dev/null 2>&1; then
    fail "C compiler missing: no \`cc\` (rustc links with it; ring, aws-lc-sys and the tests' SQLite compile C)" gcc libc6-dev
    return
  fi
  printf '#include <stdio.h>\nint main(void) { return puts("ok") < 0; }\n' >"$tmp/check.c"
  if ! out=$(cc -o "$tmp/check-c" "$tmp/check.c" 2>&1 && "$tmp/check-c" 2>&1); then
    fail "C compiler unusable: \`cc\` cannot compile, link and run a trivial C program:
$(indent "$out")" gcc libc6-dev
  fi
}

# etcd-client's build (prost-build) runs $PROTOC, or protoc from PATH, with
# -I $PROTOC_INCLUDE when that is set; check the same protoc with the same
# include path. Its protos import google/protobuf/descriptor.proto and
# struct.proto (it vendors google/api itself) and extend descriptor options
# with proto3 `optional` fields; the test file does all of that.
check_protoc() {
  local protoc=${PROTOC:-protoc} out version inc=()
  if ! command -v "$protoc" >/dev/null 2>&1; then
    fail "protoc missing: no \`$protoc\` (etcd-client's build runs it; set PROTOC to use another one)" protobuf-compiler libprotobuf-dev
    return
  fi
  if ! version=$("$protoc" --version 2>&1); then
    fail "protoc unusable: \`$protoc --version\` fails:
$(indent "$version")" protobuf-compiler libprotobuf-dev
    return
  fi
  if [ -n "${PROTOC_INCLUDE:-}" ]; then
    if [ ! -d "$PROTOC_INCLUDE" ]; then
      fail "PROTOC_INCLUDE=$PROTOC_INCLUDE is not a directory (etcd-client's build would stop on it)"
      return
    fi
    inc=(-I "$PROTOC_INCLUDE")
  fi
  mkdir -p "$tmp/proto"
  cat >"$tmp/proto/lockrouter_prereqs.proto" <<'EOF'
syntax = "proto3";
package lockrouter.prereqs;
import "google/protobuf/descriptor.proto";
import "google/protobuf/struct.proto";
extend google.protobuf.FieldOptions { optional string since = 50000; }
message Check { google.protobuf.Struct value = 1 [(since) = "3.4"]; }
EOF
  if ! out=$("$protoc" -I "$tmp/proto" "${inc[@]}" --include_imports \
    --descriptor_set_out="$tmp/check.pb" "$tmp/proto/lockrouter_prereqs.proto" 2>&1) ||
    [ ! -s "$tmp/check.pb" ]; then
    fail "protobuf well-known types missing: $protoc ($version) cannot compile a file importing google/protobuf/descriptor.proto and google/protobuf/struct.proto as etcd-client's build does (or set PROTOC_INCLUDE to the directory holding google/protobuf/):
$(indent "$out")" libprotobuf-dev
  fi
}

# etcd 3.5.0-3.5.2 can leave members with inconsistent data when killed
# under load (etcd's maintainers warn against running them); releases before
# 3.4 are end-of-life and lockrouter is not tested with them. A version we
# cannot read might be either, so refuse it too.
# 3.4.31 and 3.5.13 fix lease revocation by a stale leader (etcd issues
# #15247, #12528): lockrouter defends against it, but operators should know.
check_etcd_binary() { # path used-by
  local bin=$1 used_by=$2 out first major minor patch v
  if ! out=$("$bin" --version 2>&1); then
    fail "etcd unusable: \`$bin --version\` fails ($used_by runs it):
$(indent "$out")"
    return
  fi
  first=${out%%$'\n'*}
  if [[ ! $first =~ ^etcd\ Version:\ ([0-9]+)\.([0-9]+)\.([0-9]+)([-+][0-9A-Za-z.+-]*)?$ ]]; then
    fail "etcd version unreadable: \`$bin --version\` printed '$first', not 'etcd Version: X.Y.Z'; lockrouter needs etcd 3.4.x or >= 3.5.3 ($used_by runs it)"
    return
  fi
  major=$((10#${BASH_REMATCH[1]}))
  minor=$((10#${BASH_REMATCH[2]}))
  patch=$((10#${BASH_REMATCH[3]}))
  v=$major.$minor.$patch
  if ((major < 3 || (major == 3 && minor < 4))); then
    fail "etcd too old: $bin is etcd $v, before 3.4; lockrouter needs etcd 3.4.x or >= 3.5.3 ($used_by runs it)"
  elif ((major == 3 && minor == 5 && patch < 3)); then
    fail "etcd unsafe: $bin is etcd $v; 3.5.0-3.5.2 risk data inconsistency (etcd's maintainers warn against them); lockrouter needs etcd 3.4.x or >= 3.5.3 ($used_by runs it)"
  elif ((major == 3 && minor == 4 && patch < 31)); then
    warnings+=("$bin is etcd $v, older than 3.4.31, which fixes lease revocation by a stale leader (etcd issues #15247, #12528); lockrouter defends against it, but upgrade when you can")
  elif ((major == 3 && minor == 5 && patch < 13)); then
    warnings+=("$bin is etcd $v, older than 3.5.13, which fixes lease revocation by a stale leader (etcd issues #15247, #12528); lockrouter defends against it, but upgrade when you can")
  fi
}

# deploy/local/run.sh starts the `etcd` on PATH.
check_etcd_on_path() {
  local bin
  if ! bin=$(command -v etcd 2>/dev/null); then
    fail "etcd missing: no \`etcd\` on PATH (make run starts it)" etcd-server
    return
  fi
  check_etcd_binary "$bin" "make run"
}

# The tests and the load tests start /usr/bin/etcd, or else
# /usr/local/bin/etcd, whatever PATH says.
check_etcd_for_tests() {
  local p
  for p in /usr/bin/etcd /usr/local/bin/etcd; do
    if [ -e "$p" ]; then
      check_etcd_binary "$p" "make $mode"
      return
    fi
  done
  fail "etcd missing: neither /usr/bin/etcd nor /usr/local/bin/etcd exists (make $mode starts it)" etcd-server
}

# etcd 3.5, beside the system's 3.4: make test-etcd35 runs the safety tests
# on .prereqs/etcd-3.5/usr/bin/etcd (LOCKROUTER_ETCD_BIN), and the snapshot
# restore test among them runs the etcdctl beside it. It must run and report
# 3.5.13 or later (the first 3.5 with the stale-leader lease fixes the tests
# are meant to exercise around), and etcdctl must be of the same 3.5.
check_etcd35() {
  local bin=$etcd35_dir/usr/bin/etcd ctl=$etcd35_dir/usr/bin/etcdctl out first
  local fetch="without --check, prereqs.sh fetches Debian 13's etcd-server and etcd-client there"
  if [ ! -e "$bin" ]; then
    fail "etcd 3.5 missing: no $bin (make test runs the safety tests on etcd 3.5 too; $fetch)"
    fix fetch_etcd35
    return
  fi
  if ! out=$("$bin" --version 2>&1); then
    fail "etcd 3.5 unusable: \`$bin --version\` fails ($fetch):
$(indent "$out")"
    fix fetch_etcd35
    return
  fi
  first=${out%%$'\n'*}
  if [[ ! $first =~ ^etcd\ Version:\ 3\.5\.([0-9]+)([-+][0-9A-Za-z.+-]*)?$ ]] || ((10#${BASH_REMATCH[1]} < 13)); then
    fail "etcd 3.5 wrong version: \`$bin --version\` printed '$first'; make test needs etcd 3.5.x, x >= 13, there ($fetch)"
    fix fetch_etcd35
    return
  fi
  if ! out=$(ETCDCTL_API=3 "$ctl" version 2>&1) || [[ $out != *"etcdctl version: 3.5."* ]]; then
    fail "etcdctl 3.5 missing or unusable: \`$ctl version\` does not report 3.5 (the snapshot restore test runs it on etcd 3.5; $fetch):
$(indent "$out")"
    fix fetch_etcd35
  fi
}

# The first enabled `deb` source of this system's own release (its suite is
# VERSION_CODENAME of /etc/os-release), else the first whose URI ends in
# /debian: "URI<TAB>keyring", keyring being its Signed-By file if it names
# one. Reads one-line .list files and deb822 .sources files.
debian_mirror() {
  local codename="" files=() f
  if [ -r /etc/os-release ]; then
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  fi
  [ -e "$apt_etc/sources.list" ] && files+=("$apt_etc/sources.list")
  for f in "$apt_etc"/sources.list.d/*.list "$apt_etc"/sources.list.d/*.sources; do
    # Not our own trixie source: it is not this system's release.
    [ -e "$f" ] && [ "${f##*/}" != lockrouter-trixie.list ] && files+=("$f")
  done
  [ ${#files[@]} -gt 0 ] || return 1
  awk -v want="$codename" '
    function consider(uri, suites, keyring,   n, i, s) {
      if (keyring !~ /^\//) keyring = ""
      n = split(suites, s, " ")
      for (i = 1; i <= n; i++)
        if (want != "" && s[i] == want) { print uri "\t" keyring; found = 1; exit }
      if (fallback == "" && uri ~ /\/debian\/?$/) fallback = uri "\t" keyring
    }
    function flush(   n, i, u) {
      if (!found && (" " types " ") ~ / deb / && tolower(enabled) != "no") {
        n = split(uris, u, " ")
        for (i = 1; i <= n; i++) consider(u[i], suites, signed)
      }
      types = uris = suites = signed = enabled = ""
    }
    FNR == 1 { flush() }
    FILENAME ~ /\.sources$/ {
      if ($0 ~ /^[ \t]*$/) { flush(); next }
      if ($0 ~ /^[ \t#]/) next
      key = tolower($0); sub(/:.*/, "", key)
      value = $0; sub(/^[^:]*:[ \t]*/, "", value)
      if (key == "types") types = value
      else if (key == "uris") uris = value
      else if (key == "suites") suites = value
      else if (key == "signed-by") signed = value
      else if (key == "enabled") enabled = value
      next
    }
    $1 == "deb" {
      i = 2; keyring = ""
      if ($2 ~ /^\[/) {
        for (; i <= NF; i++) {
          if ($i ~ /^\[?signed-by=/) { keyring = $i; sub(/^\[?signed-by=/, "", keyring); sub(/\]$/, "", keyring) }
          if ($i ~ /\]$/) { i++; break }
        }
      }
      if (i + 1 <= NF) consider($i, $(i + 1), keyring)
    }
    END { if (!found) { flush(); if (!found && fallback != "") print fallback } }
  ' "${files[@]}"
}

# Adds Debian 13 (trixie) as a source on this system's Debian mirror, pinned
# at priority 1 (apt then never installs or upgrades anything from it unless
# asked by name and release), updates only that source's lists, downloads
# etcd-server and etcd-client from it and unpacks them into $etcd35_dir.
fetch_etcd35() {
  local mirror uri keyring list pin work opts="" deb
  for p in apt-get dpkg-deb; do
    if ! command -v "$p" >/dev/null 2>&1; then
      echo "prereqs: fetching etcd 3.5 needs $p (a Debian system)" >&2
      return 1
    fi
  done
  if ! mirror=$(debian_mirror) || [ -z "$mirror" ]; then
    echo "prereqs: no Debian source in $apt_etc/sources.list or $apt_etc/sources.list.d/ to take the mirror for trixie from" >&2
    return 1
  fi
  uri=${mirror%%$'\t'*}
  keyring=${mirror#*$'\t'}
  [ -z "$keyring" ] || opts="[signed-by=$keyring] "
  list=$apt_etc/sources.list.d/lockrouter-trixie.list
  pin=$apt_etc/preferences.d/lockrouter-trixie
  echo "prereqs: fetching etcd 3.5 from Debian 13 (trixie) on $uri into $etcd35_dir ..." >&2
  # The pin first: no moment in which trixie has apt's default priority.
  "${sudo[@]}" mkdir -p "$apt_etc/preferences.d" "$apt_etc/sources.list.d"
  printf '%s\n' "# lockrouter: etcd 3.5 for its tests is fetched from trixie (deploy/local/prereqs.sh);" \
    "# priority 1: nothing is installed or upgraded from trixie unless asked for by name." \
    "Package: *" "Pin: release n=trixie" "Pin-Priority: 1" | "${sudo[@]}" tee "$pin" >/dev/null
  printf '%s\n' "# lockrouter: etcd 3.5 for its tests (deploy/local/prereqs.sh), pinned in ../preferences.d/lockrouter-trixie" \
    "deb ${opts}$uri trixie main" | "${sudo[@]}" tee "$list" >/dev/null
  # Only this source's lists; the others are left as they are.
  "${sudo[@]}" apt-get update -qq -o Dir::Etc::sourcelist="$list" \
    -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 || return 1
  # Not under $tmp (mode 0700): apt downloads as its sandbox user, _apt.
  work=$etcd35_dir.download
  rm -rf "$work" "$etcd35_dir.new"
  mkdir -p "$work" "$etcd35_dir.new"
  chmod 0777 "$work"
  (cd "$work" && "${sudo[@]}" apt-get download -qq etcd-server/trixie etcd-client/trixie) || return 1
  for deb in "$work"/*.deb; do
    [ -e "$deb" ] || {
      echo "prereqs: apt-get download left no .deb" >&2
      return 1
    }
    dpkg-deb -x "$deb" "$etcd35_dir.new" || return 1
  done
  "${sudo[@]}" rm -rf "$work"
  rm -rf "$etcd35_dir"
  mv "$etcd35_dir.new" "$etcd35_dir"
}

# The dashboard tests run promtool and prometheus from PATH.
check_prometheus() {
  local tool out
  for tool in prometheus promtool; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      fail "$tool missing (the dashboard tests of make test run it)" prometheus
    elif ! out=$("$tool" --version 2>&1); then
      fail "$tool unusable: \`$tool --version\` fails:
$(indent "$out")" prometheus
    fi
  done
}

# The snapshot restore test saves and restores a shard with the etcdctl of
# the etcd it runs (/usr/bin/etcdctl, else /usr/local/bin/etcdctl): a restore
# by another major.minor may write a data dir that etcd does not read.
check_etcdctl() {
  local p bin="" out etcd_v
  for p in /usr/bin/etcdctl /usr/local/bin/etcdctl; do
    if [ -e "$p" ]; then
      bin=$p
      break
    fi
  done
  if [ -z "$bin" ]; then
    fail "etcdctl missing: neither /usr/bin/etcdctl nor /usr/local/bin/etcdctl exists (the snapshot restore test of make test runs it)" etcd-client
    return
  fi
  if ! out=$(ETCDCTL_API=3 "$bin" version 2>&1); then
    fail "etcdctl unusable: \`$bin version\` fails:
$(indent "$out")" etcd-client
    return
  fi
  for p in /usr/bin/etcd /usr/local/bin/etcd; do
    [ -e "$p" ] || continue
    etcd_v=$("$p" --version 2>/dev/null) || etcd_v=""
    [[ $etcd_v =~ ^etcd\ Version:\ ([0-9]+\.[0-9]+)\. ]] || return 0
    etcd_v=${BASH_REMATCH[1]}
    if [[ $out != *"etcdctl version: $etcd_v."* ]]; then
      fail "etcdctl does not match etcd: $bin reports '${out%%$'\n'*}' but $p is etcd $etcd_v (install both from one release)" etcd-client
    fi
    return
  done
}

# The partition tests put etcd members in network namespaces joined by
# bridges and veth pairs; make one of each, and delete it.
check_netns() {
  local ns="lockrouter-prereqs-$$" out
  if ! command -v ip >/dev/null 2>&1; then
    fail "ip missing: no iproute2 \`ip\` (the partition tests of make test run it)" iproute2
    return
  fi
  if ! out=$(ip netns add "$ns" 2>&1 &&
    ip -n "$ns" link add lrbr type bridge 2>&1 &&
    ip -n "$ns" link add lrv0 type veth peer name lrv1 2>&1 &&
    ip -n "$ns" link set lrv0 master lrbr 2>&1); then
    ip netns del "$ns" >/dev/null 2>&1 || true
    fail "network namespaces unusable: \`ip\` cannot make a namespace with a bridge and a veth pair (the partition tests of make test need root and a kernel with netns, bridge and veth support):
$(indent "$out")"
    return
  fi
  ip netns del "$ns"
}

# make test-python makes target/python-venv with `python3 -m venv` and
# installs the SDK with that venv's pip; make test-api-fuzz does the same in
# target/api-fuzz-venv for schemathesis (tests/api-fuzz/requirements.txt).
# Both the SDK and that schemathesis release need Python 3.11. Debian
# splits venv (ensurepip) and pip out of python3, so make a venv and run its
# pip, rather than trusting the interpreter alone.
check_python() {
  local out v major minor
  if ! command -v python3 >/dev/null 2>&1; then
    fail "python3 missing (make test-python runs the Python SDK's tests with it, make test-api-fuzz the API fuzzer)" python3 python3-venv python3-pip
    return
  fi
  if ! out=$(python3 --version 2>&1); then
    fail "python3 unusable: \`python3 --version\` fails:
$(indent "$out")" python3 python3-venv python3-pip
    return
  fi
  if [[ ! $out =~ ^Python\ ([0-9]+)\.([0-9]+)\. ]]; then
    fail "python3 version unreadable: \`python3 --version\` printed '${out%%$'\n'*}', not 'Python X.Y.Z'; the Python SDK needs Python >= 3.11" python3
    return
  fi
  major=$((10#${BASH_REMATCH[1]}))
  minor=$((10#${BASH_REMATCH[2]}))
  v=$major.$minor
  if ((major < 3 || (major == 3 && minor < 11))); then
    fail "python3 too old: $(command -v python3) is Python $v; the Python SDK (make test-python) needs Python >= 3.11, as does the API fuzzer (make test-api-fuzz)" python3
    return
  fi
  if ! out=$(python3 -m venv "$tmp/venv" 2>&1); then
    fail "python3 cannot make a venv: \`python3 -m venv\` fails (make test-python and make test-api-fuzz make one):
$(indent "$out")" python3-venv python3-pip
    return
  fi
  if ! out=$("$tmp/venv/bin/pip" --version 2>&1); then
    fail "a new venv has no working pip: \`venv/bin/pip --version\` fails (make test-python installs the SDK with it, make test-api-fuzz schemathesis):
$(indent "$out")" python3-venv python3-pip
  fi
}

# The TypeScript SDK's tests (make test-typescript) run `npm ci` and
# `npm test` (tsc, then node's test runner); the SDK needs Node >= 20
# (global fetch, AbortSignal reasons, the test runner).
check_node() {
  local out major
  if ! command -v node >/dev/null 2>&1; then
    fail "node missing (make test-typescript runs the TypeScript SDK's tests with it)" nodejs npm
    return
  fi
  if ! out=$(node --version 2>&1); then
    fail "node unusable: \`node --version\` fails:
$(indent "$out")" nodejs npm
    return
  fi
  if [[ ! $out =~ ^v([0-9]+)\. ]]; then
    fail "node version unreadable: \`node --version\` printed '${out%%$'\n'*}', not 'vX.Y.Z'; the TypeScript SDK needs Node >= 20" nodejs
    return
  fi
  major=$((10#${BASH_REMATCH[1]}))
  if ((major < 20)); then
    fail "node too old: $(command -v node) is Node $out; the TypeScript SDK (make test-typescript) needs Node >= 20" nodejs
    return
  fi
  if ! out=$(npm --version 2>&1); then
    fail "npm missing or unusable: \`npm --version\` fails (make test-typescript installs the SDK's build tools with it):
$(indent "$out")" npm
  fi
}

# The status page's browser test (tests/ui.rs) starts the `chromedriver` on
# PATH, which drives the `chromium` on PATH headless. A driver speaks only to
# a browser of its own major version, so compare them; and load a page with
# the test's flags, since a browser that prints its version may still lack a
# library it needs to render.
check_chromium() {
  local tool out browser="" driver="" re='([0-9]+)\.[0-9]+\.[0-9]+\.[0-9]+'
  for tool in chromium chromedriver; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      fail "$tool missing (the status page's browser test of make test runs it)" chromium chromium-driver
    elif ! out=$("$tool" --version 2>&1); then
      fail "$tool unusable: \`$tool --version\` fails:
$(indent "$out")" chromium chromium-driver
    elif [[ ! $out =~ $re ]]; then
      fail "$tool version unreadable: \`$tool --version\` printed '${out%%$'\n'*}', with no version X.Y.Z.W" chromium chromium-driver
    elif [ "$tool" = chromium ]; then
      browser=${BASH_REMATCH[1]}
    else
      driver=${BASH_REMATCH[1]}
    fi
  done
  [ -n "$browser" ] && [ -n "$driver" ] || return 0
  if [ "$browser" != "$driver" ]; then
    fail "chromedriver does not match chromium: chromedriver is version $driver, chromium $browser (a driver drives only its own major version; install both from one release)" chromium chromium-driver
    return
  fi
  # Bounded: a browser stuck on a broken display or profile must not hang
  # the check. XDG dirs in $tmp: Chromium writes its crash database and
  # caches there, not in the caller's home.
  if ! out=$(XDG_CONFIG_HOME="$tmp/chromium-config" XDG_CACHE_HOME="$tmp/chromium-cache" \
    timeout 60 chromium --headless --no-sandbox --disable-gpu --disable-quic \
    --no-first-run --disable-background-networking --disable-component-update \
    --disable-sync --user-data-dir="$tmp/chromium" \
    --dump-dom 'data:text/html,<p>lockrouter-prereqs-ok</p>' 2>&1) ||
    [[ $out != *"<p>lockrouter-prereqs-ok</p>"* ]]; then
    fail "chromium cannot load a page headless (the status page's browser test needs it):
$(indent "$out")" chromium
  fi
}

run_checks() {
  problems=()
  need=()
  fixes=()
  warnings=()
  local c
  for c in "${checks[@]}"; do "$c"; done
}

report() {
  local w p
  for w in "${warnings[@]}"; do echo "prereqs: warning: $w" >&2; done
  for p in "${problems[@]}"; do echo "prereqs: $p" >&2; done
}

run_checks
# Each package once, in the order the checks asked for them.
pkgs=()
for p in "${need[@]}"; do
  [[ " ${pkgs[*]} " == *" $p "* ]] || pkgs+=("$p")
done

# What the install step does, for messages: packages, and other steps.
todo() {
  local what=""
  [ ${#pkgs[@]} -eq 0 ] || what="installs ${pkgs[*]}"
  if [[ " ${steps[*]} " == *" fetch_etcd35 "* ]]; then
    what+="${what:+ and }fetches etcd 3.5 into $etcd35_dir"
  fi
  echo "$what"
}
steps=("${fixes[@]}")

if [ ${#problems[@]} -gt 0 ] && [ "$check_only" = 0 ] && [ $((${#pkgs[@]} + ${#steps[@]})) -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    report
    if [ ${#pkgs[@]} -gt 0 ]; then
      echo "prereqs: no apt-get here: install the equivalent of Debian's ${pkgs[*]} with your package manager (etcd 3.4.x or >= 3.5.3)" >&2
    fi
    if [ ${#steps[@]} -gt 0 ]; then
      echo "prereqs: no apt-get here: put an etcd 3.5.x (x >= 13) with its etcdctl in $etcd35_dir/usr/bin/ yourself" >&2
    fi
    exit 1
  fi
  sudo=()
  if [ "$EUID" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      report
      echo "prereqs: $(todo): that needs root or sudo" >&2
      exit 1
    fi
    sudo=(sudo)
  fi
  if [ ${#pkgs[@]} -gt 0 ]; then
    echo "prereqs: installing ${pkgs[*]} ..." >&2
    "${sudo[@]}" apt-get update -qq
    # --no-install-recommends is safe because what we need from the recommends
    # is named: libprotobuf-dev (recommended by protobuf-compiler) and libc6-dev
    # (recommended by gcc). `env` because sudo drops the caller's environment.
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    # Debian's prometheus package enables a service listening on :9090. The
    # tests start their own servers on free ports and never use it; stop the
    # one we just installed so it does not scrape or hold the port.
    if [[ " ${pkgs[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
      "${sudo[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  fi
  # A step that fails says why; the checks below then say what is missing.
  for step in "${steps[@]}"; do "$step" || true; done
  # Installing is no proof: a PROTOC or an etcd elsewhere on PATH may still be
  # the one that runs.
  run_checks
fi

report
if [ ${#problems[@]} -gt 0 ]; then
  if [ "$check_only" = 1 ] && [ $((${#pkgs[@]} + ${#steps[@]})) -gt 0 ]; then
    echo "prereqs: without --check, $0 $mode $(todo)" >&2
  fi
  exit 1
fi
