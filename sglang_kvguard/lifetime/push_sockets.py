"""kvguard's own ZMQ PUSH sockets to peer ranks: the drain answers (transfer_drain), the
rejection and abort notices (rejection_notice, decode_rejection_notice) and decode's
drain requests (decode_destination_hold) travel on them, never on upstream's sockets."""

from __future__ import annotations


def push_socket(ctx, endpoint: str, port: int):
    """A kvguard-owned ZMQ PUSH socket to ``endpoint:port`` (IPv4 or IPv6), LINGER 0.

    Never shared with upstream's sockets; each caller keeps its own per thread."""
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    host = endpoint
    if ":" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{endpoint}]"
    sock.connect(f"tcp://{host}:{int(port)}")
    return sock


class PushSockets:
    """kvguard-owned PUSH sockets by (endpoint, port), made on first use, all from one
    ZMQ context (``ctx``, or one made on first use). For the thread that owns it."""

    def __init__(self, ctx=None) -> None:
        self.ctx = ctx
        self._sockets: dict = {}

    def get(self, endpoint: str, port: int):
        key = (endpoint, int(port))
        sock = self._sockets.get(key)
        if sock is None:
            if self.ctx is None:
                import zmq

                self.ctx = zmq.Context()
            sock = self._sockets[key] = push_socket(self.ctx, endpoint, port)
        return sock
