"""peer_liveness: when is the peer of a failed Mooncake send gone for good?"""

from __future__ import annotations

import socket

from sglang_kvguard.lifetime.peer_liveness import ALIVE, REFUSED, UNKNOWN, PeerWatch, parse_address, tcp_probe


def test_addresses():
    assert parse_address("10.0.0.1:17000") == ("10.0.0.1", 17000)
    assert parse_address("[::1]:17000") == ("::1", 17000)
    assert parse_address("host-without-port") is None
    assert parse_address("host:notaport") is None
    assert tcp_probe("timed-out") == UNKNOWN


def test_real_probes():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    peer = f"127.0.0.1:{s.getsockname()[1]}"
    assert tcp_probe(peer) == ALIVE
    s.close()
    assert tcp_probe(peer) == REFUSED


def _watch(verdicts):
    return PeerWatch(interval=3600, confirm=2, probe=lambda p: verdicts[p], autostart=False)


def test_only_consecutive_refusals_confirm_and_every_peer_must_be_gone():
    verdicts = {"a:1": REFUSED, "b:2": ALIVE}
    w = _watch(verdicts)
    done = []
    assert w.watch(["a:1", "b:2"], lambda: done.append("ab"))
    assert w.watch(["a:1"], lambda: done.append("a"))
    verdicts["a:1"] = REFUSED
    assert w.poll_once() == 0
    verdicts["a:1"] = UNKNOWN  # a timeout breaks the run: it may be a partition that heals
    w.poll_once()
    verdicts["a:1"] = REFUSED
    assert w.poll_once() == 0 and done == []
    assert w.poll_once() == 1 and done == ["a"]
    for _ in range(3):
        w.poll_once()
    assert done == ["a"], "a peer that accepts connections was called gone"
    verdicts["b:2"] = REFUSED
    w.poll_once()
    w.poll_once()
    assert done == ["a", "ab"] and w.watched() == 0


def test_a_failing_callback_does_not_stop_the_others_and_off_means_never():
    w = _watch({"a:1": REFUSED})
    done = []
    w.watch(["a:1"], lambda: 1 / 0)
    w.watch(["a:1"], lambda: done.append(1))
    w.poll_once()
    assert w.poll_once() == 2 and done == [1]
    off = PeerWatch(interval=0, autostart=False)
    assert not off.watch(["a:1"], lambda: None) and off.watched() == 0
    assert not w.watch([], lambda: None)
