"""Is a transfer peer gone for good? Its Mooncake session port refuses connections.

Mooncake does not cancel a failed batch (``batch_transfer_sync`` gives up at its
wall-clock timeout and drops the handle), so kvguard keeps the pages of a failed
send pinned (prefill_source_hold). There is no call in Mooncake's Python API that
says when such a batch really ended. One thing does prove it can no longer touch
the pages: the peer process is gone. Every connection to a dead process is reset,
so the transport's writes to it fail, and nothing reads the source pages for it.

A peer counts as dead when a TCP connect to its session address (``host:port``, the
address the batch was sent to) is refused ``confirm`` times in a row, ``interval``
seconds apart. Only a refusal counts: a connect that times out or finds no route
may be a partition that heals (and a stalled TCP stream that resumes), and a
frozen process (SIGSTOP) still accepts connections on its listening socket. A
peer restarted on the same address accepts again: it is not confirmed dead, and
the pages stay held (fail closed).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

log = logging.getLogger("sglang_kvguard")

REFUSED, ALIVE, UNKNOWN = "refused", "alive", "unknown"


def parse_address(peer: str) -> Optional[Tuple[str, int]]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); None if it is not one."""
    host, sep, port = str(peer).rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def tcp_probe(peer: str, timeout: float = 2.0) -> str:
    addr = parse_address(peer)
    if addr is None:
        return UNKNOWN
    try:
        with socket.create_connection(addr, timeout=timeout):
            return ALIVE
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return UNKNOWN


class _Entry:
    __slots__ = ("pending", "on_dead", "what")

    def __init__(self, pending: Set[str], on_dead: Callable[[], None], what: str) -> None:
        self.pending = pending
        self.on_dead = on_dead
        self.what = what


class PeerWatch:
    """Calls each registered callback once every peer it names is confirmed dead."""

    def __init__(self, interval: float = 5.0, confirm: int = 2,
                 probe: Callable[[str], str] = tcp_probe, autostart: bool = True) -> None:
        self.autostart = autostart  # False: the caller drives ``poll_once`` (tests)
        self.interval = float(interval)
        self.confirm = int(confirm)
        self.probe = probe
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._entries: List[_Entry] = []
        self._refusals: Dict[str, int] = {}
        self._thread: Optional[threading.Thread] = None
        self.stats = {"watched": 0, "confirmed_dead": 0, "settled": 0}

    def watch(self, peers: Iterable[str], on_dead: Callable[[], None], what: str = "") -> Optional[_Entry]:
        """Register ``on_dead``; returns a handle for ``cancel``, or None (nothing registered)
        when watching is off or no peer is known."""
        pending = {str(p) for p in peers if p}
        if self.interval <= 0 or not pending:
            return None
        entry = _Entry(pending, on_dead, what)
        with self._lock:
            self._entries.append(entry)
            self.stats["watched"] += 1
            if self.autostart and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="kvguard-peer-watch", daemon=True)
                self._thread.start()
        return entry

    def cancel(self, entry: Optional[_Entry]) -> None:
        """The watched send settled some other way: forget it."""
        if entry is None:
            return
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]

    def watched(self) -> int:
        with self._lock:
            return len(self._entries)

    def poll_once(self) -> int:
        """Probe every watched peer once; returns how many callbacks ran."""
        with self._lock:
            peers = sorted({p for e in self._entries for p in e.pending})
        dead = []
        for peer in peers:
            verdict = self.probe(peer)
            with self._lock:
                n = self._refusals.get(peer, 0) + 1 if verdict == REFUSED else 0
                if n >= self.confirm:
                    self._refusals.pop(peer, None)
                    dead.append(peer)
                elif n:
                    self._refusals[peer] = n
                else:
                    self._refusals.pop(peer, None)
        if not dead:
            return 0
        for peer in dead:
            self.stats["confirmed_dead"] += 1
            log.warning("kvguard: transfer peer %s refused %d connections in a row, %.0f s apart: it is gone, so "
                        "no send to it can still touch our pages", peer, self.confirm, self.interval)
        ready = []
        with self._lock:
            for e in self._entries:
                e.pending.difference_update(dead)
            ready = [e for e in self._entries if not e.pending]
            self._entries = [e for e in self._entries if e.pending]
        for e in ready:
            self.stats["settled"] += 1
            try:
                e.on_dead()
            except Exception as exc:  # noqa: BLE001 - one callback must not stop the others
                log.error("kvguard: settling %s after its peer died failed: %s", e.what or "a send", exc)
        return len(ready)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - keep watching
                log.error("kvguard peer watch: %s", exc)
            with self._lock:
                if not self._entries:
                    self._thread = None
                    return


WATCH = PeerWatch()


def configure(interval: float) -> None:
    """``--kvguard-peer-probe-interval`` (0: never probe, failed sends stay held until restart)."""
    WATCH.interval = float(interval)


def watch() -> PeerWatch:
    """This process's watch (looked up at each call: tests replace it)."""
    return WATCH
