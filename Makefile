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

test: lint
	cargo test --workspace -- --test-threads=3
