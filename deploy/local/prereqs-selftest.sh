#!/usr/bin/env bash
# Proves that prereqs.sh refuses what would break the build or the tests:
# each case runs prereqs.sh (mostly `--check`) with a PATH holding only a
# sandbox directory of fake etcd, cargo and prometheus programs beside the
# real C toolchain and protoc, so a missing or unsafe item is simulated
# without uninstalling anything. The only apt-get and sudo a case ever finds
# are fakes that log their arguments, so nothing is installed: it needs no
# network and no root, and takes a few seconds. `make test` runs it.
set -euo pipefail

script=$(cd "$(dirname "$0")" && pwd)/prereqs.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Real programs every sandbox keeps: those prereqs.sh itself runs, and the
# C toolchain (cc finds its assembler and linker on PATH). They are wrapper
# scripts, not symlinks: a case that replaces one with a fake must never
# write through a link into the system's own binary (CI runs as root).
mkdir -p "$tmp/real"
for t in mktemp rm mkdir cat env timeout cc as ld make protoc awk tee chmod mv dpkg-deb tar; do
  p=$(command -v "$t") || {
    echo "prereqs-selftest: $t is missing; run deploy/local/prereqs.sh build first" >&2
    exit 1
  }
  printf '#!/bin/sh\nexec %q "$@"\n' "$p" >"$tmp/real/$t"
  chmod +x "$tmp/real/$t"
done
# A protoc that finds no well-known types by itself: protoc looks for them
# beside its own executable, so a copy in the sandbox finds none.
cp "$(readlink -f "$(command -v protoc)")" "$tmp/protoc-bare"

# Minimal stand-ins for the well-known types, to prove PROTOC_INCLUDE is
# passed to protoc as etcd-client's build passes it.
mkdir -p "$tmp/inc-partial/google/protobuf" "$tmp/inc-full/google/protobuf"
cat >"$tmp/inc-full/google/protobuf/descriptor.proto" <<'EOF'
syntax = "proto2";
package google.protobuf;
message FieldOptions { extensions 1000 to max; }
EOF
cat >"$tmp/inc-full/google/protobuf/struct.proto" <<'EOF'
syntax = "proto3";
package google.protobuf;
message Struct {}
EOF
cp "$tmp/inc-full/google/protobuf/descriptor.proto" "$tmp/inc-partial/google/protobuf/"

fake() { # dir name body: a program printing or failing as told
  rm -f "$1/$2" # a new file, whatever was there
  printf '#!/bin/sh\n%s\n' "$3" >"$1/$2"
  chmod +x "$1/$2"
}

# A stand-in for cc that "builds" (prereqs.sh runs `cc -o OUT IN`) a program
# that succeeds: compiling C for real in every case would take seconds. The
# cases about the C compiler, and the first one, use the real cc.
fake_cc="exec $(printf %q "$(type -P cp)") $(printf %q "$(type -P true)") \"\$2\""

# Every case starts from a copy of this: real tools, fake cc, cargo and
# prometheus, and etcd 3.4.31 (a version that passes without a warning).
etcd_version() { fake "$bin" etcd "echo 'etcd Version: $1'; echo 'Git SHA: fake'"; }
bin=$tmp/template
cp -R "$tmp/real" "$bin"
fake "$bin" cc "$fake_cc"
fake "$bin" cargo 'echo "cargo 1.80.0"'
fake "$bin" prometheus 'echo "prometheus, version 2.42.0"'
fake "$bin" promtool 'echo "promtool, version 2.42.0"'
fake "$bin" ip 'exit 0'
etcd_version "3.4.31"
# A python3 that reports VERSION and makes a "venv" as VENV says: ok (with
# a pip that works), nopip (a pip that fails) or noensurepip (Debian's
# python3 without python3-venv).
fake "$tmp" pip-good 'echo "pip 23.0.1 from /fake (python 3.11)"'
fake "$tmp" pip-broken 'echo "ModuleNotFoundError: No module named pip" >&2; exit 1'
python_fake() { # version venv
  local venv
  case $2 in
    ok) venv="$(printf %q "$(type -P mkdir)") -p \"\$3/bin\" && $(printf %q "$(type -P cp)") $(printf %q "$tmp/pip-good") \"\$3/bin/pip\"" ;;
    nopip) venv="$(printf %q "$(type -P mkdir)") -p \"\$3/bin\" && $(printf %q "$(type -P cp)") $(printf %q "$tmp/pip-broken") \"\$3/bin/pip\"" ;;
    noensurepip) venv='echo "The virtual environment was not created successfully because ensurepip is not available." >&2; exit 1' ;;
  esac
  fake "$bin" python3 "case \$1 in --version) echo 'Python $1' ;; -m) $venv ;; *) exit 2 ;; esac"
}
python_fake 3.11.7 ok
fake "$bin" node 'echo v20.11.1'
fake "$bin" npm 'echo 10.2.4'
# A chromium of major version $1 that renders the check's page (or, with
# `broken`, fails to start as a browser missing a library does), and a
# chromedriver of major version $2.
chromium_fake() { # browser-major driver-major [broken]
  local page='echo "<html><head></head><body><p>lockrouter-prereqs-ok</p></body></html>"'
  [ "${3:-}" != broken ] || page='echo "error while loading shared libraries: libgbm.so.1" >&2; exit 127'
  fake "$bin" chromium "case \$1 in --version) echo 'Chromium $1.0.8078.114 built on Debian GNU/Linux 12 (bookworm)' ;; *) $page ;; esac"
  fake "$bin" chromedriver "echo 'ChromeDriver $2.0.8078.114 (ea19f97-refs/branch-heads/8078@{#5})'"
}
chromium_fake 156 156

# etcd 3.5 beside the system's (check_etcd35): every case finds a good one
# in its own prereqs dir unless it says otherwise, and an apt configuration
# dir of its own, so that no case reads or writes the machine's /etc/apt.
etcd35_fake() { # dir etcd-version etcdctl-version
  mkdir -p "$1/etcd-3.5/usr/bin"
  fake "$1/etcd-3.5/usr/bin" etcd "echo 'etcd Version: $2'; echo 'Git SHA: fake'"
  fake "$1/etcd-3.5/usr/bin" etcdctl "echo 'etcdctl version: $3'; echo 'API version: 3.5'"
}
# Debian packages as apt-get download would leave them: etcd-server and
# etcd-client of 3.5.16 holding fake programs, built with the real dpkg-deb.
for pkg in etcd-server:etcd:"etcd Version: 3.5.16" etcd-client:etcdctl:"etcdctl version: 3.5.16"; do
  IFS=: read -r name prog line <<<"$pkg"
  mkdir -p "$tmp/deb/$name/DEBIAN" "$tmp/deb/$name/usr/bin"
  printf 'Package: %s\nVersion: 3.5.16-4\nArchitecture: all\nMaintainer: selftest <selftest@invalid>\nDescription: fake\n' "$name" >"$tmp/deb/$name/DEBIAN/control"
  fake "$tmp/deb/$name/usr/bin" "$prog" "echo '$line'"
  dpkg-deb -b "$tmp/deb/$name" "$tmp/${name}_3.5.16-4_all.deb" >/dev/null
done

n=0
sandbox() {
  n=$((n + 1))
  bin=$tmp/case$n
  cp -R "$tmp/template" "$bin"
  export LOCKROUTER_PREREQS_DIR=$tmp/prereqs$n LOCKROUTER_PREREQS_APT_ETC=$tmp/apt$n
  etcd35_fake "$LOCKROUTER_PREREQS_DIR" 3.5.16 3.5.16
  mkdir -p "$LOCKROUTER_PREREQS_APT_ETC/sources.list.d"
}
real_cc() { rm "$bin/cc" && cp "$tmp/real/cc" "$bin/cc"; }

failures=0
# expect RC PATTERN [args...]: run prereqs.sh in the sandbox with the given
# args; its exit status must be RC and its output must match the extended
# regex PATTERN, matched against the output joined into one line ('^$':
# print nothing).
expect() {
  local want_rc=$1 pattern=$2 out rc=0
  shift 2
  out=$(env -u PROTOC -u PROTOC_INCLUDE ${protoc:+PROTOC="$protoc"} ${include:+PROTOC_INCLUDE="$include"} \
    PATH="$bin" "$BASH" "$script" "$@" 2>&1) || rc=$?
  if [ "$rc" != "$want_rc" ] || ! grep -Eq -- "$pattern" <<<"${out//$'\n'/ }" || { [ "$pattern" = '^$' ] && [ -n "$out" ]; }; then
    echo "prereqs-selftest: FAIL case $n ($*${protoc:+, PROTOC=$protoc}${include:+, PROTOC_INCLUDE=$include}): want exit $want_rc and /$pattern/, got exit $rc:" >&2
    printf '%s\n' "$out" | sed 's/^/    /' >&2
    failures=$((failures + 1))
  fi
  protoc="" include=""
}
protoc="" include=""

# Everything present and recent, with the real C compiler: silent success.
sandbox && real_cc
expect 0 '^$' --check run

# etcd versions: refused, warned about, or fine.
for v in 3.5.0 3.5.1 3.5.2; do
  sandbox && etcd_version "$v"
  expect 1 "etcd unsafe: .*etcd $v; 3\.5\.0-3\.5\.2 risk data inconsistency" --check run
done
for v in 3.3.25 2.3.8; do
  sandbox && etcd_version "$v"
  expect 1 "etcd too old: .*etcd $v, before 3\.4" --check run
done
sandbox && fake "$bin" etcd "echo 'etcd Version: 3.5'"
expect 1 "etcd version unreadable: .*printed 'etcd Version: 3\.5'" --check run
sandbox && fake "$bin" etcd "echo 'etcd version 3.5.9'"
expect 1 "etcd version unreadable" --check run
sandbox && fake "$bin" etcd 'echo "flag provided but not defined: -version" >&2; exit 2'
expect 1 "etcd unusable: .*flag provided but not defined" --check run
sandbox && etcd_version 3.4.23
expect 0 "warning: .*etcd 3\.4\.23, older than 3\.4\.31, which fixes lease revocation by a stale leader" --check run
sandbox && etcd_version 3.5.3
expect 0 "warning: .*etcd 3\.5\.3, older than 3\.5\.13" --check run
sandbox && etcd_version 3.5.12
expect 0 "warning: .*etcd 3\.5\.12, older than 3\.5\.13" --check run
for v in 3.5.13 3.6.0 3.6.0-rc.1; do
  sandbox && etcd_version "$v"
  expect 0 '^$' --check run
done
sandbox && rm "$bin/etcd"
expect 1 "etcd missing: no \`etcd\` on PATH .*\[Debian: etcd-server\]" --check run
# make build needs no etcd at all.
sandbox && rm "$bin/etcd"
expect 0 '^$' --check build

# protoc, and the well-known types it must find.
sandbox && rm "$bin/protoc"
expect 1 "protoc missing: .*\[Debian: protobuf-compiler libprotobuf-dev\]" --check build
sandbox && fake "$bin" protoc 'echo "error while loading shared libraries: libprotoc.so.32" >&2; exit 127'
expect 1 "protoc unusable: .*libprotoc\.so\.32" --check build
sandbox && rm "$bin/protoc" && cp "$tmp/protoc-bare" "$bin/protoc"
expect 1 "protobuf well-known types missing: .*google/protobuf/descriptor\.proto: File not found.*\[Debian: libprotobuf-dev\]" --check build
sandbox && protoc=$tmp/protoc-bare include=$tmp/inc-partial
expect 1 "google/protobuf/struct\.proto: File not found" --check build
sandbox && protoc=$tmp/protoc-bare include=$tmp/inc-full
expect 0 '^$' --check build
sandbox && include=$tmp/no-such-dir
expect 1 "PROTOC_INCLUDE=.*no-such-dir is not a directory" --check build

# The C compiler must compile, link and run.
sandbox && rm "$bin/cc"
expect 1 "C compiler missing: .*\[Debian: gcc libc6-dev\]" --check build
sandbox && fake "$bin" cc "echo \"cc: fatal error: cannot execute 'as'\" >&2; exit 1"
expect 1 "C compiler unusable: .*cannot execute 'as'" --check build
sandbox && real_cc && rm "$bin/ld"
expect 1 "C compiler unusable: .*ld" --check build

# make builds jemalloc, the router's allocator.
sandbox && rm "$bin/make"
expect 1 "make missing or unusable: .*\[Debian: make\]" --check build

sandbox && rm "$bin/cargo"
expect 1 "cargo is missing: install Rust with rustup" --check build

# make test also needs prometheus and promtool (its etcd is the system's,
# whatever the sandbox holds, so only the prometheus lines are asserted).
sandbox && rm "$bin/prometheus" "$bin/promtool"
expect 1 "prometheus missing .*\[Debian: prometheus\]" --check test
sandbox && rm "$bin/promtool"
expect 1 "promtool missing .*\[Debian: prometheus\]" --check test

# ... and iproute2's ip, able to make a namespace with a bridge and veths.
sandbox && rm "$bin/ip"
expect 1 "ip missing: .*\[Debian: iproute2\]" --check test
sandbox && fake "$bin" ip 'echo "mount --make-shared /run/netns failed: Operation not permitted" >&2; exit 1'
expect 1 "network namespaces unusable: .*Operation not permitted" --check test

# ... and python3 >= 3.11 that makes a venv whose pip runs.
sandbox && rm "$bin/python3"
expect 1 "python3 missing .*\[Debian: python3 python3-venv python3-pip\]" --check test
sandbox && python_fake 3.9.2 ok
expect 1 "python3 too old: .*Python 3\.9; .*needs Python >= 3\.11" --check test
sandbox && python_fake 3.11 ok
expect 1 "python3 version unreadable: .*printed 'Python 3\.11'" --check test
sandbox && python_fake 3.11.2 noensurepip
expect 1 "python3 cannot make a venv: .*ensurepip is not available.*\[Debian: python3-venv python3-pip\]" --check test
sandbox && python_fake 3.12.1 nopip
expect 1 "a new venv has no working pip: .*No module named pip.*\[Debian: python3-venv python3-pip\]" --check test
# A good one is not reported (the rest of `test` depends on this machine's
# etcd, so only the absence of a python3 line is asserted).
sandbox
out=$(env -u PROTOC -u PROTOC_INCLUDE PATH="$bin" "$BASH" "$script" --check test 2>&1) || true
if grep -qi python <<<"$out"; then
  echo "prereqs-selftest: FAIL case $n: a good python3 was reported:" >&2
  printf '%s\n' "$out" | sed 's/^/    /' >&2
  failures=$((failures + 1))
fi

# ... and node >= 20 with npm.
sandbox && rm "$bin/node"
expect 1 "node missing .*\[Debian: nodejs npm\]" --check test
sandbox && fake "$bin" node 'echo v18.19.0'
expect 1 "node too old: .*Node v18\.19\.0; .*needs Node >= 20" --check test
sandbox && fake "$bin" npm 'echo "npm: command not found" >&2; exit 127'
expect 1 "npm missing or unusable: .*\[Debian: npm\]" --check test

# ... and chromium with a chromedriver of its own major version, able to
# load a page headless.
sandbox && rm "$bin/chromium"
expect 1 "chromium missing .*\[Debian: chromium chromium-driver\]" --check test
sandbox && rm "$bin/chromedriver"
expect 1 "chromedriver missing .*\[Debian: chromium chromium-driver\]" --check test
sandbox && chromium_fake 156 150
expect 1 "chromedriver does not match chromium: chromedriver is version 150, chromium 156" --check test
sandbox && fake "$bin" chromedriver 'echo "ChromeDriver"'
expect 1 "chromedriver version unreadable: .*printed 'ChromeDriver'" --check test
sandbox && chromium_fake 156 156 broken
expect 1 "chromium cannot load a page headless .*libgbm\.so\.1.*\[Debian: chromium\]" --check test
# A good pair is not reported (as for python3 above).
sandbox
out=$(env -u PROTOC -u PROTOC_INCLUDE PATH="$bin" "$BASH" "$script" --check test 2>&1) || true
if grep -qi chrom <<<"$out"; then
  echo "prereqs-selftest: FAIL case $n: a good chromium was reported:" >&2
  printf '%s\n' "$out" | sed 's/^/    /' >&2
  failures=$((failures + 1))
fi

# Installing mode: with no apt-get it names the packages and fails; what
# no package fixes fails without trying to install.
sandbox && rm "$bin/etcd" "$bin/cc"
expect 1 "no apt-get here: install the equivalent of Debian's gcc libc6-dev etcd-server" run
sandbox && rm "$bin/cargo"
expect 1 "^prereqs: cargo is missing" run

# Installing mode with a fake apt-get (and sudo, for a non-root run) that
# logs its arguments and "installs" etcd-server by dropping in a fake etcd:
# each failing check's packages are installed once, and everything is
# checked again afterwards.
fake "$tmp" etcd-good "echo 'etcd Version: 3.4.31'"
fake_apt() { # installs-etcd: yes|no
  local cp_etcd=":"
  [ "$1" = no ] || cp_etcd="$(printf '%q ' "$(type -P cp)" "$tmp/etcd-good" "$bin/etcd")"
  fake "$bin" apt-get "echo \"\$*\" >>$(printf %q "$bin/apt.log")
case \" \$* \" in *' install '*' etcd-server '*) $cp_etcd ;; esac"
  fake "$bin" sudo 'exec "$@"'
}
sandbox && rm "$bin/etcd" && fake_apt yes
expect 0 "^prereqs: installing etcd-server \.\.\.$" run
log=$(cat "$bin/apt.log" 2>/dev/null || true)
if [ "$log" != $'update -qq\ninstall -y -qq --no-install-recommends etcd-server' ]; then
  echo "prereqs-selftest: FAIL case $n: apt-get was called as:" >&2
  printf '    %s\n' "$log" >&2
  failures=$((failures + 1))
fi
# An install that does not fix the check (an etcd elsewhere on PATH, a
# package of the wrong version) still fails.
sandbox && rm "$bin/etcd" && fake_apt no
expect 1 "installing etcd-server .*etcd missing: no \`etcd\` on PATH" run

# etcd 3.5 for make test and make bench: it must run and be 3.5.13 or
# later, with an etcdctl of 3.5; --check reports it and fetches nothing.
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR" && fake_apt no
expect 1 "etcd 3\.5 missing: no .*/etcd-3\.5/usr/bin/etcd .*without --check, .* bench fetches etcd 3\.5 into" --check bench
if [ -e "$bin/apt.log" ]; then
  echo "prereqs-selftest: FAIL case $n: --check ran apt-get: $(cat "$bin/apt.log")" >&2
  failures=$((failures + 1))
fi
sandbox && etcd35_fake "$LOCKROUTER_PREREQS_DIR" 3.5.12 3.5.12
expect 1 "etcd 3\.5 wrong version: .*printed 'etcd Version: 3\.5\.12'; make test needs etcd 3\.5\.x, x >= 13" --check bench
sandbox && etcd35_fake "$LOCKROUTER_PREREQS_DIR" 3.4.23 3.4.23
expect 1 "etcd 3\.5 wrong version: .*'etcd Version: 3\.4\.23'" --check test
sandbox && fake "$LOCKROUTER_PREREQS_DIR/etcd-3.5/usr/bin" etcd 'echo "version \`GLIBC_2.34'"'"' not found" >&2; exit 1'
expect 1 "etcd 3\.5 unusable: .*GLIBC_2\.34" --check bench
sandbox && rm "$LOCKROUTER_PREREQS_DIR/etcd-3.5/usr/bin/etcdctl"
expect 1 "etcdctl 3\.5 missing or unusable" --check bench
sandbox && etcd35_fake "$LOCKROUTER_PREREQS_DIR" 3.5.16 3.4.23
expect 1 "etcdctl 3\.5 missing or unusable: .*etcdctl version: 3\.4\.23" --check bench
# make build and make run need none.
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR"
expect 0 '^$' --check run

# Fetching it: trixie goes on the mirror of the system's own sources (a
# deb822 .sources file here, its keyring kept), pinned at priority 1 before
# anything is fetched; only that source's lists are updated; etcd-server
# and etcd-client are downloaded from trixie and unpacked, and checked.
fake_fetch_apt() {
  fake "$bin" apt-get "echo \"\$*\" >>$(printf %q "$bin/apt.log")
case \" \$* \" in *' download '*) $(printf '%q ' "$(type -P cp)" "$tmp/etcd-server_3.5.16-4_all.deb" "$tmp/etcd-client_3.5.16-4_all.deb") . ;; esac"
  fake "$bin" sudo 'exec "$@"'
}
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR" && fake_fetch_apt
printf 'Types: deb\nURIs: http://mirror.invalid/debian\nSuites: nosuch nosuch-updates\nComponents: main\nSigned-By: /usr/share/keyrings/fake.gpg\n\nTypes: deb\nURIs: http://mirror.invalid/debian-security\nSuites: nosuch-security\nComponents: main\n' \
  >"$LOCKROUTER_PREREQS_APT_ETC/sources.list.d/debian.sources"
expect 0 "^prereqs: fetching etcd 3\.5 from Debian 13 \(trixie\) on http://mirror\.invalid/debian into " bench
apt=$LOCKROUTER_PREREQS_APT_ETC
want_log="update -qq -o Dir::Etc::sourcelist=$apt/sources.list.d/lockrouter-trixie.list -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
download -qq etcd-server/trixie etcd-client/trixie"
if [ "$(cat "$bin/apt.log" 2>/dev/null)" != "$want_log" ] ||
  ! grep -qx 'deb \[signed-by=/usr/share/keyrings/fake.gpg\] http://mirror.invalid/debian trixie main' "$apt/sources.list.d/lockrouter-trixie.list" ||
  ! grep -qx 'Pin: release n=trixie' "$apt/preferences.d/lockrouter-trixie" ||
  ! grep -qx 'Pin-Priority: 1' "$apt/preferences.d/lockrouter-trixie" ||
  [ "$("$LOCKROUTER_PREREQS_DIR/etcd-3.5/usr/bin/etcd")" != "etcd Version: 3.5.16" ]; then
  echo "prereqs-selftest: FAIL case $n: the fetch did not do what it should; apt-get was called as:" >&2
  sed 's/^/    /' "$bin/apt.log" >&2
  cat "$apt/sources.list.d/lockrouter-trixie.list" "$apt/preferences.d/lockrouter-trixie" >&2 || true
  failures=$((failures + 1))
fi
# A one-line sources.list: its mirror, and its signed-by among other options.
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR" && fake_fetch_apt
printf '# a comment\ndeb [arch=amd64 signed-by=/k/one.gpg] http://one.invalid/debian/ nosuch main\n' >"$LOCKROUTER_PREREQS_APT_ETC/sources.list"
expect 0 "fetching etcd 3\.5 .* on http://one\.invalid/debian/ " bench
if ! grep -qx 'deb \[signed-by=/k/one.gpg\] http://one.invalid/debian/ trixie main' "$LOCKROUTER_PREREQS_APT_ETC/sources.list.d/lockrouter-trixie.list"; then
  echo "prereqs-selftest: FAIL case $n: wrong trixie source from a one-line sources.list" >&2
  failures=$((failures + 1))
fi
# No Debian source to take a mirror from: nothing fetched, and it says so.
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR" && fake_fetch_apt
expect 1 "no Debian source in .*to take the mirror for trixie from.*etcd 3\.5 missing" bench
# A download that brings a package of the wrong version is refused.
sandbox && rm -r "$LOCKROUTER_PREREQS_DIR" && fake_apt no
printf 'deb http://one.invalid/debian nosuch main\n' >"$LOCKROUTER_PREREQS_APT_ETC/sources.list"
expect 1 "apt-get download left no \.deb.*etcd 3\.5 missing" bench

sandbox
expect 2 "usage: " --check nonsense

if [ "$failures" -gt 0 ]; then
  echo "prereqs-selftest: $failures of $n cases failed" >&2
  exit 1
fi
echo "prereqs-selftest: $n cases passed" >&2
