"""Small, release-tolerant readers of SGLang ``Req`` state shared by guards."""

from __future__ import annotations


def pending_abort(req) -> bool:
    """The request carries a rejection/abort that has not been delivered yet."""
    to_finish = getattr(req, "to_finish", None)
    if to_finish is None:
        return False
    if type(to_finish).__name__ != "FINISH_ABORT":
        return False
    return not req.finished()


def holds_resources(req) -> bool:
    """The request already owns KV, a metadata slot or a retraction backup.

    Such a request is released by its own queue, never drained at a door (the same
    rule as upstream's ``is_unadmitted_reject`` in 0.5.21+).
    """
    if getattr(req, "is_retracted", False):
        return True
    if getattr(req, "metadata_buffer_index", -1) >= 0:
        return True
    kv = getattr(req, "kv", None)
    if kv is not None:  # 0.5.19+: req.kv.*
        if getattr(kv, "holds_kv", False) or getattr(kv, "holds_mamba", False):
            return True
        if getattr(kv, "retraction_backup", None) is not None:
            return True
        return False
    if getattr(req, "req_pool_idx", None) is not None:
        return True
    return False


def is_unadmitted_reject(req) -> bool:
    return pending_abort(req) and not holds_resources(req)


def abort_reason(req):
    return getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)


def req_row(req):
    """The request's req_to_token row: ``req.req_pool_idx`` (<= 0.5.18) or ``req.kv.req_pool_idx`` (0.5.19+)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return getattr(req, "req_pool_idx", None)


def committed_len(req):
    """Tokens of KV the request holds: ``kv_committed_len`` on ``req.kv`` (0.5.16+) or on ``req``; None if absent."""
    for holder in (getattr(req, "kv", None), req):
        n = getattr(holder, "kv_committed_len", None) if holder is not None else None
        if isinstance(n, int):
            return n
    return None
