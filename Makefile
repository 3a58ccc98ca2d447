# `make run` starts three local etcd shards and the router; `make test` runs
# formatting, lints and the full test suite against real etcd processes.
.PHONY: run test prereqs build fmt lint

prereqs:
	@deploy/local/prereqs.sh

run: prereqs
	@deploy/local/run.sh

build: prereqs
	cargo build --release

fmt:
	cargo fmt --all

lint: prereqs
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# The dashboard tests run Prometheus, etcd and a router under load and check
# every panel within a deadline: they get the machine to themselves.
test: lint
	cargo test --workspace -- --test-threads=3 --skip dashboards::
	cargo test -p lockrouter --test tests -- --test-threads=1 dashboards::

# Benchmarks (loadtest/, docs/benchmarks.md). Both start their own etcd
# shards and router on loopback and stop them when done, even on failure.
# `make bench`: the full run, release build, about 20 minutes; writes
# target/bench/ (summary.json, summary.md, goose HTML reports).
# `make bench-smoke`: every scenario and baseline at small sizes on a debug
# build (quick to compile after `make test`); fails on request errors or
# accounting that does not add up. CI runs it.
.PHONY: bench bench-smoke
bench: prereqs
	cargo build --release -p lockrouter --bin lockrouter
	cargo build --release -p lockrouter-loadtest
	./target/release/lockrouter-loadtest --profile full --out target/bench

bench-smoke: prereqs
	cargo build -p lockrouter --bin lockrouter
	cargo build -p lockrouter-loadtest
	./target/debug/lockrouter-loadtest --profile smoke --check --out target/bench/smoke
