"""Port picking for the demo/test deployments (no SGLang needed)."""

import socket

from sglang_kvguard.demo.deployment import _ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if lo - 20000 >= 1000:
        # bind(0)/ZMQ random ports come from the ephemeral range; ours must not.
        assert all(20000 <= p < lo for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_excluded_and_busy_ports_are_skipped():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        held = busy.getsockname()[1]
        first = free_ports(5)
        again = free_ports(50, exclude=first + [held])
        assert not set(again) & set(first)
        assert held not in again
