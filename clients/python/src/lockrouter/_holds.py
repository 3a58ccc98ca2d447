"""Who in this client holds each name, shared by the sync and async clients.

The router knows one holder per client id, so it would hand two threads
(or tasks) of one client the same grant and both would "hold" the name.
Users of other lock libraries (redis-py, Redisson, kazoo) expect a lock to
exclude every other caller, their own threads included; so a client lets
one hold of a name (per client id) at a time: another acquire of it waits
its turn, first come first served, for as long as its wait allows, or gets
nothing.

A name's turn is taken before the acquire is sent and kept by the grant's
``Lock`` until it is released (or garbage-collected), so no two acquires
of one name by one client are on the wire at once. A lost lock keeps its
turn until its ``Lock`` is released: the next holder then gets a new grant
with a larger token, never the lost one's.

Re-entrance is asked for explicitly: a re-entrant acquire of a name this
client holds (and has not lost) joins the hold, counted; the grant is
released when the last of its holds lets go. Every method is safe from any
thread (a finalizer may let go of a hold anywhere).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from ._state import LockState, Release

Key = tuple[str, str]  # (client id, name)


class Ticket:
    """A waiter for a name's turn; ``wake`` is called (from any thread,
    without blocking) when the turn is handed to it."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.granted = False


class _Entry:
    def __init__(self) -> None:
        self.taken = False
        self.holder: LockState | None = None
        self.count = 0
        # The grant whose last hold let go, keeping the turn until its
        # release has begun (see ``Holds.pass_on``).
        self.leaving: LockState | None = None
        self.queue: collections.deque[Ticket] = collections.deque()


class Holds:
    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._names: dict[Key, _Entry] = {}
        self._closed = False

    def close(self) -> None:
        """The client is closing: wakes every waiter, without the turn (it
        then finds the client closed), and queues none from now on."""
        with self._mu:
            self._closed = True
            waiters = [t for e in self._names.values() for t in e.queue]
            for e in self._names.values():
                e.queue.clear()
        for t in waiters:
            t.wake()

    def enter(self, key: Key, ticket: Ticket) -> bool:
        """Takes the turn if it is free (True); else queues ``ticket``."""
        with self._mu:
            e = self._names.setdefault(key, _Entry())
            if not e.taken:
                e.taken = True
                return True
            if not self._closed:
                e.queue.append(ticket)
            else:
                ticket.wake()
            return False

    def leave(self, key: Key, ticket: Ticket) -> bool:
        """A waiter stops waiting (its time ran out, or it was cancelled):
        True if the turn was handed to it meanwhile (it owns it now)."""
        with self._mu:
            if ticket.granted:
                return True
            e = self._names.get(key)
            if e is not None:
                try:
                    e.queue.remove(ticket)
                except ValueError:
                    pass
                self._tidy(key, e)
            return False

    def hold(self, key: Key, state: LockState) -> None:
        """The turn's acquire got ``state``: its first hold."""
        with self._mu:
            e = self._names.setdefault(key, _Entry())
            e.taken, e.holder, e.count = True, state, 1

    def join(self, key: Key) -> LockState | None:
        """A re-entrant acquire: one more hold of the grant holding ``key``,
        if it is not lost and not being released."""
        with self._mu:
            e = self._names.get(key)
            s = e.holder if e is not None else None
            if s is None or s.lost_now() is not None or s.release is not Release.NOT_STARTED:
                return None
            assert e is not None
            e.count += 1
            return s

    def holding(self, key: Key) -> int | None:
        """The fencing token of the grant holding ``key``, if not lost."""
        with self._mu:
            e = self._names.get(key)
            s = e.holder if e is not None else None
        if s is None or s.lost_now() is not None:
            return None
        return s.ref.fencing_token

    def let_go(self, state: LockState) -> bool:
        """One hold of ``state`` lets go: True if it was the last (release
        the grant now) or ``state`` holds no turn here. The last hold keeps
        the name's turn: call ``pass_on`` once the release has begun, so
        that the next in line finds it under way instead of asking the
        router while the grant stands and being handed that same grant."""
        key = (state.client_id, state.name)
        with self._mu:
            e = self._names.get(key)
            if e is None or e.holder is not state:
                return True
            e.count -= 1
            if e.count > 0:
                return False
            # No re-entrant acquire joins it from now on.
            e.holder, e.count, e.leaving = None, 0, state
        return True

    def pass_on(self, state: LockState) -> None:
        """``state``'s release has begun: the turn its last hold kept goes
        to the next in line (nothing if it kept none)."""
        key = (state.client_id, state.name)
        with self._mu:
            e = self._names.get(key)
            if e is None or e.leaving is not state:
                return
        self.pass_turn(key)

    def pass_turn(self, key: Key) -> None:
        """The turn's owner is done: the first waiter gets it."""
        with self._mu:
            e = self._names.get(key)
            if e is None:
                return
            e.holder, e.count, e.leaving = None, 0, None
            nxt = e.queue.popleft() if e.queue else None
            if nxt is None:
                e.taken = False
                self._tidy(key, e)
            else:
                nxt.granted = True
        if nxt is not None:
            nxt.wake()

    def _tidy(self, key: Key, e: _Entry) -> None:
        if not e.taken and not e.queue:
            self._names.pop(key, None)

    def __len__(self) -> int:
        with self._mu:
            return len(self._names)
