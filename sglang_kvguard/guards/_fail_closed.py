"""Failing a decode request closed through upstream's own metadata-corruption path
(shared by the commit-time checks and the head-sliced refusal)."""

from __future__ import annotations

from http import HTTPStatus


def fail_request(decode_req, message: str) -> None:
    """Upstream's own metadata-corruption path: abort 500, drop the receiver."""
    from sglang.srt.disaggregation import decode as decode_mod

    decode_mod.prepare_abort(decode_req.req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    receiver = decode_req.kv_receiver
    if receiver is not None:
        receiver.clear()
    decode_req.kv_receiver = None
