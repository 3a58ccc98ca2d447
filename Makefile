# `make run` starts three local etcd shards and the router; `make test` runs
# formatting, lints and the full test suite against real etcd processes.
.PHONY: run test test-python test-typescript test-api-fuzz build fmt lint
.PHONY: prereqs prereqs-build prereqs-run prereqs-bench prereqs-check

# Each target checks what it needs, and installs what is missing from Debian
# packages (deploy/local/prereqs.sh says what and why). `make prereqs`
# prepares everything `make test` needs; `make prereqs-check` only verifies
# that, installing nothing.
prereqs:
	@deploy/local/prereqs.sh test
prereqs-build:
	@deploy/local/prereqs.sh build
prereqs-run:
	@deploy/local/prereqs.sh run
prereqs-bench:
	@deploy/local/prereqs.sh bench
prereqs-check:
	@deploy/local/prereqs.sh --check test

run: prereqs-run
	@deploy/local/run.sh

# `make run` with auth on: a lockId key and an admin principal's bearer token,
# made once under .local/auth/ and printed at start (deploy/local/run.sh).
.PHONY: run-auth
run-auth: prereqs-run
	@deploy/local/run.sh --auth

build: prereqs-build
	cargo build --release

fmt:
	cargo fmt --all

lint: prereqs-build
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --document-private-items

# prereqs-selftest.sh proves the checks refuse what they must (fake binaries,
# a few seconds). The dashboard tests run Prometheus, etcd and a router under
# load and check every panel within a deadline, and the renewal test judges
# live clients' 2 s locks while thousands of leases expire: they get the
# machine to themselves.
#
# Every debug build below is `cargo test --workspace` or DEBUG_BUILD, which
# compile the same crates with the same features: a stage that selected
# fewer packages (`-p lockrouter`, `--test tests`, `--bin lockrouter`) would
# resolve other features and compile most dependencies again (about two
# minutes each on a 2-core machine). Filters match test names: lib unit
# tests live in `mod tests`, integration tests never do.
DEBUG_BUILD := cargo build --workspace --all-targets
test: prereqs lint
	deploy/local/prereqs-selftest.sh
	cargo test --workspace -- --test-threads=3 --skip dashboards:: --skip renewals::
	cargo test --workspace --tests -- --test-threads=1 dashboards:: renewals:: --skip ::tests::
	$(MAKE) test-etcd35
	$(MAKE) test-python
	$(MAKE) test-typescript
	$(MAKE) test-api-fuzz

# The safety tests a second time, on etcd 3.5: Debian 13's 3.5.16, which
# `make prereqs` unpacks into .prereqs/etcd-3.5/ beside the system's 3.4
# (deploy/local/prereqs.sh); the testkit runs the etcd that
# LOCKROUTER_ETCD_BIN names, and fails if it cannot run it. What runs: the
# history-checked fault tests (paused leader, the torture test with every
# fault kind), the partitions, shard identity (swapped endpoints, copied
# and restored shards, epoch bumps), rebalancing, FIFO waits, the
# fenced-out paused holders, and from locks:: the tests of mutual
# exclusion, tokens, renewals, expiry, stale lockIds and early lease
# revocation. Left out: what does not depend on etcd's release (HTTP
# surface, config, SDKs, tenants, TLS), the long lock tests of counting and
# sweeping, and the silent-member test, whose 2 s locks judge renewal
# latency rather than safety and are lost by a few ms when three tests
# share two busy cores (it runs on 3.4 in the suite above). About 2
# minutes with three at a time (109 s for `make test-etcd35` on a 2-core
# machine with other builds running), which keeps CI's whole run under 30
# minutes; the torture test (60 s) is most of it.
ETCD35_BIN := $(CURDIR)/.prereqs/etcd-3.5/usr/bin/etcd
ETCD35_TESTS := faults:: partitions:: identity:: rebalance:: wait:: fencing:: \
	locks::exactly_one locks::tokens_strictly locks::renew locks::expir \
	locks::stale_lock_id locks::a_renewal_sent_after locks::a_lease_revoked_early
.PHONY: test-etcd35
test-etcd35: prereqs-bench
	LOCKROUTER_ETCD_BIN=$(ETCD35_BIN) cargo test --workspace --tests -- \
		--test-threads=3 $(ETCD35_TESTS) --skip faults::a_silent_member --skip ::tests::

# The Python SDK (clients/python, docs/client.md) against a real router and
# real etcd started by its fixtures: builds the router, keeps a venv in
# target/python-venv (made once), installs the SDK editable with its test
# extras, and runs pytest, each test bounded by pytest-timeout and the whole
# run by timeout(1); the tests' temp dirs (etcd's data among them) go under
# target/, not the system's temp dir. Two pytest-xdist workers (the tests
# mostly wait for their processes; each worker picks ports from its own
# share of the range). About a minute.
PYTHON_VENV := target/python-venv
test-python:
	$(DEBUG_BUILD)
	test -x $(PYTHON_VENV)/bin/pip || python3 -m venv $(PYTHON_VENV)
	$(PYTHON_VENV)/bin/pip install --quiet --disable-pip-version-check -e 'clients/python[test]'
	LOCKROUTER_BIN=$(CURDIR)/target/debug/lockrouter timeout 300 \
		$(PYTHON_VENV)/bin/python -m pytest clients/python/tests -q --timeout 60 -n 2 \
			--basetemp $(CURDIR)/target/pytest-tmp

# The TypeScript SDK (clients/typescript, docs/client.md) against a real
# router and real etcd started by its tests: builds the router, installs the
# SDK's build tools from its lock file (npm ci), compiles with tsc and runs
# node's test runner, the whole run bounded by timeout(1). Under a minute.
test-typescript:
	$(DEBUG_BUILD)
	cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error
	cd clients/typescript && LOCKROUTER_BIN=$(CURDIR)/target/debug/lockrouter timeout 300 npm test

# The HTTP API against docs/openapi.yaml (tests/api-fuzz/run.py, whose header
# says what it sends and checks): builds the router, keeps a venv in
# target/api-fuzz-venv (made once) with schemathesis and its dependencies at
# the exact versions of tests/api-fuzz/requirements.txt, starts three real
# etcd shards and the router on free loopback ports, and runs schemathesis
# over every operation with a fixed seed and at most 100 generated cases per
# operation. Fails on any 5xx, undocumented answer or dropped connection, and
# when etcd or the router cannot start; the whole run is bounded by
# timeout(1). About a minute (the first run also fills the venv).
API_FUZZ_VENV := target/api-fuzz-venv
test-api-fuzz:
	$(DEBUG_BUILD)
	test -x $(API_FUZZ_VENV)/bin/pip || python3 -m venv $(API_FUZZ_VENV)
	$(API_FUZZ_VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/api-fuzz/requirements.txt
	LOCKROUTER_BIN=$(CURDIR)/target/debug/lockrouter timeout 300 \
		$(API_FUZZ_VENV)/bin/python tests/api-fuzz/run.py

# Benchmarks (loadtest/, docs/benchmarks.md). Both start their own etcd
# shards and router on loopback and stop them when done, even on failure.
# `make bench`: the full run, release build, about 20 minutes; writes
# target/bench/ (summary.json, summary.md, goose HTML reports).
# `make bench-smoke`: every scenario and baseline at small sizes on a debug
# build (quick to compile after `make test`); fails on request errors or
# accounting that does not add up. CI runs it.
.PHONY: bench bench-smoke
bench: prereqs-bench
	cargo build --release -p lockrouter --bin lockrouter
	cargo build --release -p lockrouter-loadtest
	./target/release/lockrouter-loadtest --profile full --out target/bench
	@# The paired tables, the barrier and hold again on etcd 3.5 (the release to deploy;
	@# docs/capacity.md compares what each costs), beside the run above.
	LOCKROUTER_ETCD_BIN=$(ETCD35_BIN) ./target/release/lockrouter-loadtest --profile full \
		--scenarios direct,naive,barrier,uncontested,latency,hold --out target/bench/etcd-3.5
	@# Both runs' targets in one table, a column per release: target/bench/compare.md.
	./target/release/lockrouter-loadtest --compare target/bench,target/bench/etcd-3.5 --out target/bench

bench-smoke: prereqs-bench
	$(DEBUG_BUILD)
	./target/debug/lockrouter-loadtest --profile smoke --check --out target/bench/smoke
