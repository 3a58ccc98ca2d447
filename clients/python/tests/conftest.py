"""Fixtures: each test gets its own etcd and router processes (a few hundred
milliseconds each), so tests that kill them cannot disturb others. A
missing etcd or router binary fails the test with what to do, never skips
it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterator

import pytest

from harness import Etcd, Router, Tls

logging.getLogger("lockrouter").setLevel(logging.DEBUG)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list]:
    started: list = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture
def start_etcd(tmp_path: Path, processes: list) -> Callable[[], Etcd]:
    def start() -> Etcd:
        e = Etcd(tmp_path)
        processes.append(e)
        return e

    return start


@pytest.fixture
def start_router(tmp_path: Path, processes: list) -> Callable[..., Router]:
    def start(shards: list[Etcd], port: int | None = None, extra: str = "", tls: Tls | None = None) -> Router:
        r = Router(tmp_path, shards, port, extra, tls)
        processes.append(r)
        return r

    return start


@pytest.fixture
def etcd(start_etcd: Callable[[], Etcd]) -> Etcd:
    return start_etcd()


@pytest.fixture
def router(etcd: Etcd, start_router: Callable[..., Router]) -> Router:
    return start_router([etcd])


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    """A CA and a certificate for 127.0.0.1 it signed, made for the test."""
    return Tls.make(tmp_path)
