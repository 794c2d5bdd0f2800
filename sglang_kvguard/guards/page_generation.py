"""Per-page generation tags: decode never reads a KV page that changed owner under it.

Every physical page of the decode KV pool carries a 32-bit generation
(``GenerationTable.gens``). It changes each time the page goes back to the free list,
so a page handed to a new owner never carries the generation its previous owner
recorded. kvguard bumps it at the allocator's free sink, the one place every free
passes through (``free`` up to 0.5.16, ``_release_page_ids`` from 0.5.17, the token
allocator's ``free``), after any other guard decided what is really freed.

Each decode request records the generations of the pages behind its
``req_to_token`` row:

* when decode reserves its pages (``DecodePreallocQueue._pre_alloc``): the whole row,
  pages reserved for the incoming transfer and prefix pages shared from decode's radix
  cache alike;
* after every batch build (``Scheduler.update_running_batch``): the page slots the
  step added (a request crossing a page boundary).

Before every decode batch build, i.e. before any forward reads the cache, one kernel
(``kernels.batch_generation_mismatch``: Triton on GPU, the bit-identical torch
reference on CPU) compares the recorded generations of every running request with
the pool's current ones. A request with a mismatch fails closed: it leaves the batch
before the forward, the client gets a 500 naming the page, the log names the request
and the pages (``generation_mismatches`` counter). Its pages whose generation still
matches are freed; a page that changed owner is never freed by it (it belongs to
someone else now); prefix pages shared with the radix cache are left to the cache.

A request whose row was not recorded by kvguard (a path that does not go through
``_pre_alloc``) is recorded on first sight instead of being compared against a
stale record of the row's previous owner (``generation_first_seen`` counter).

With decode's radix cache on (``--disaggregation-decode-enable-radix-cache``), the
cache rewrites a request's row when it inserts the request's prefix
(``ScheduleBatchDisaggregationDecodeMixin.process_prebuilt`` ->
``cache_unfinished_req`` / ``checkpoint_kv_cache``): pages that duplicate what the
tree already holds are freed and the row points at the tree's pages instead (found
on 0.5.19: records that did not follow gave false mismatches). kvguard checks the
batch's records just before that insert and records the rewritten rows just after
it. A request whose check fails there is barred from the tree
(``skip_radix_cache_insert``: pages another request now owns never become a shared
prefix) and is failed closed by the next batch check.

Hybrid pools (SWA / Mamba / hisparse allocators) are not tagged; a decode node on
one refuses to start while this guard is active (``hybrid_pool_check``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Callable, Dict, List, Optional

from ..engine.process import SCHEDULER_INIT, pd_role
from ..engine.guard import ACTIVE, Decision, Guard
from ..engine.targets import target
from ._req import committed_len, req_row
from .prefill_source_hold import PAGED_FREE, PAGED_RELEASE, TOKEN_FREE, _in_free_group

log = logging.getLogger("sglang_kvguard")

PRE_ALLOC = target(
    "disagg.decode.DecodePreallocQueue._pre_alloc",
    "sglang.srt.disaggregation.decode:DecodePreallocQueue._pre_alloc",
    why="decode: reserves a request's row and pages for the incoming transfer",
)
PROCESS_PREBUILT = target(
    "disagg.decode.ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
    "sglang.srt.disaggregation.decode_schedule_batch_mixin:ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
    why="decode: inserts each new request's prefix into the radix cache, which may rewrite its row",
)
UPDATE_RUNNING_BATCH = target(
    "scheduler.Scheduler.update_running_batch",
    "sglang.srt.managers.scheduler:Scheduler.update_running_batch",
    why="decode: builds each decode step's batch (allocates the step's new pages) before the forward",
)

ROLE = "decode"
ATTR = "_kvguard_generations"  # on the allocator: its GenerationTable
REQ_ATTR = "_kvguard_generation_row"  # on a Req: the row kvguard recorded for it
TAGGED_ALLOCATORS = ("PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator")
_warned = {"check": False}


class GenerationTable:
    """Page generations of one decode allocator and the records of its requests."""

    def __init__(self, allocator, req_to_token) -> None:
        import torch

        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self.req_to_token = req_to_token
        device = req_to_token.device
        n_pages = int(allocator.size) // self.page_size + 2  # page 0 is the padding slot
        self.gens = torch.zeros(n_pages, dtype=torch.int32, device=device)
        rows, tokens = req_to_token.shape
        self.width = -(-int(tokens) // self.page_size)
        self.rec = torch.zeros(int(rows), self.width, dtype=torch.int32, device=device)
        self.rec_len = torch.zeros(int(rows), dtype=torch.int32, device=device)
        self.stats = {"bumped": 0, "recorded": 0, "checked": 0, "skipped": 0, "mismatches": 0, "first_seen": 0,
                      "extend_skipped": 0}
        # Every free that changes a generation advances the epoch. A row verified clean (or
        # recorded whole) at the current epoch cannot have a mismatch yet: no generation
        # changed since, so the batch check skips its kernel when every row of the batch
        # is such a row (most decode steps: requests grow without freeing). Relies on a
        # row's recorded slots not being re-pointed without a free; upstream re-points them
        # only in the radix insert, which frees the duplicates (an epoch) and after which
        # checked_insert records the rows again.
        self.epoch = 0
        self.row_epoch: Dict[int, int] = {}

    # -- free sink
    def bump_pages(self, page_ids) -> None:
        from .. import kernels

        if page_ids.numel():
            # first: even a bump that fails part way leaves every row to be checked again
            # (the allocator, and so this, runs on the scheduler thread only)
            self.epoch += 1
            kernels.bump_generations(self.gens, page_ids.to(self.gens.device))
            self.stats["bumped"] += int(page_ids.numel())

    # -- records
    def _record(self, reqs, rows: List[int], n_tokens: List[int]) -> None:
        """Record rows from their first page slot up to ``n_tokens`` each, in one kernel call."""
        from .. import kernels

        ends = [min(-(-int(n) // self.page_size), self.width) for n in n_tokens]
        epoch = self.epoch
        kernels.record_generations(self.gens, self.req_to_token, self.rec, self.rec_len, rows, [0] * len(rows), ends,
                                   self.page_size)
        for r, row in zip(reqs, rows):
            setattr(r, REQ_ATTR, row)
            self.row_epoch[row] = epoch  # recorded whole from the generations of this epoch
        self.stats["recorded"] += len(rows)

    def record_row(self, req, row: int, n_tokens: int) -> None:
        self._record([req], [row], [n_tokens])

    def record_rows(self, reqs) -> None:
        """Record whole rows (up to each request's committed length) in one kernel call."""
        kept = [(r, req_row(r), committed_len(r)) for r in reqs]
        kept = [k for k in kept if k[1] is not None and k[2] is not None]
        if kept:
            self._record([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept])

    def _rows(self, reqs) -> List[int]:
        return [req_row(r) for r in reqs]

    def adopt_unrecorded(self, reqs, rows) -> None:
        """Requests whose row kvguard did not record for them: forget the row's old record."""
        fresh = [row for r, row in zip(reqs, rows) if getattr(r, REQ_ATTR, None) != row]
        if not fresh:
            return
        for r, row in zip(reqs, rows):
            if getattr(r, REQ_ATTR, None) != row:
                setattr(r, REQ_ATTR, row)
        import torch

        self.rec_len[torch.tensor(fresh, dtype=torch.int64, device=self.rec_len.device)] = 0
        for row in fresh:
            self.row_epoch[row] = self.epoch  # nothing recorded: nothing to mismatch
        self.stats["first_seen"] += len(fresh)
        from ..engine import metrics

        metrics.count("generation_first_seen", n=len(fresh))

    def mismatched(self, reqs) -> List[int]:
        """Indices into ``reqs`` of requests with a page whose generation changed."""
        from .. import kernels

        rows = self._rows(reqs)
        self.adopt_unrecorded(reqs, rows)
        epoch = self.epoch
        if all(self.row_epoch.get(row) == epoch for row in rows):
            self.stats["skipped"] += len(rows)  # no generation changed since each row was verified
            return []
        flags = kernels.batch_generation_mismatch(self.gens, self.req_to_token, self.rec, self.rec_len, rows,
                                                  self.page_size)
        self.stats["checked"] += len(rows)
        bad = [i for i, b in enumerate(flags.tolist()) if b] if bool(flags.any()) else []
        bad_set = set(bad)
        for i, row in enumerate(rows):
            if i not in bad_set:  # a mismatch is never remembered as clean
                self.row_epoch[row] = epoch
        return bad

    def extend(self, reqs, seq_lens) -> None:
        """Record the slots a decode step added (up to each request's current length)."""
        import torch

        from .. import kernels

        rows = self._rows(reqs)
        self.adopt_unrecorded(reqs, rows)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.rec_len.device)
        ends = torch.div(seq_lens.to(device=idx.device, dtype=torch.int64) + self.page_size - 1, self.page_size,
                         rounding_mode="floor")
        starts = self.rec_len.index_select(0, idx).to(torch.int64)
        if idx.device.type == "cpu" and not bool((ends > starts).any()):
            # No row grew into a new page (15 steps in 16 for one request at page 16): the
            # kernel would record empty ranges. Only where reading the lengths costs no
            # device sync; rows that did not grow cost the kernel nothing either way.
            self.stats["extend_skipped"] += 1
            return
        kernels.record_generations(self.gens, self.req_to_token, self.rec, self.rec_len, idx, starts,
                                   torch.maximum(starts, ends), self.page_size)

    def detail(self, row: int):
        from ..kernels import reference

        return reference.mismatched_slots(self.gens, self.req_to_token, self.rec, self.rec_len, row, self.page_size)

    def recorded_pages(self, row: int) -> List[int]:
        n = int(self.rec_len[row])
        toks = self.req_to_token[row, : n * self.page_size : self.page_size].tolist()
        return [int(t) // self.page_size for t in toks]


def table_of(allocator) -> Optional[GenerationTable]:
    return getattr(allocator, ATTR, None) if allocator is not None else None


def bind(allocator, req_to_token_pool) -> Optional[GenerationTable]:
    """Tag ``allocator``'s pages (decode role); None for allocators kvguard does not tag."""
    if type(allocator).__name__ not in TAGGED_ALLOCATORS:
        log.warning("kvguard page_generation: %s is not a plain paged/token allocator; its pages are not tagged",
                    type(allocator).__name__)
        return None
    table = GenerationTable(allocator, req_to_token_pool.req_to_token)
    setattr(allocator, ATTR, table)
    return table


# ----------------------------------------------------------------------------- free sinks


def _paged_free(original: Callable) -> Callable:
    """<= 0.5.16: ``free(token_indices)``."""

    def free(self, free_index, *args, **kwargs):
        out = original(self, free_index, *args, **kwargs)
        table = getattr(self, ATTR, None)
        if table is not None and not _in_free_group(self) and free_index is not None and free_index.numel():
            table.bump_pages(free_index // table.page_size)
        return out

    return free


def _paged_release(original: Callable) -> Callable:
    """0.5.17+: ``_release_page_ids(*page_ids)``."""

    def _release_page_ids(self, *page_ids):
        out = original(self, *page_ids)
        table = getattr(self, ATTR, None)
        if table is not None:
            for ids in page_ids:
                table.bump_pages(ids)
        return out

    return _release_page_ids


def _token_free(original: Callable) -> Callable:
    def free(self, free_index, *args, **kwargs):
        out = original(self, free_index, *args, **kwargs)
        table = getattr(self, ATTR, None)
        if table is not None and not _in_free_group(self) and free_index is not None and free_index.numel():
            table.bump_pages(free_index)
        return out

    return free


# ----------------------------------------------------------------------------- records and checks


def _pre_alloc(original: Callable) -> Callable:
    def _pre_alloc(self, req, *args, **kwargs):
        out = original(self, req, *args, **kwargs)
        try:
            table = table_of(getattr(self, "token_to_kv_pool_allocator", None))
            if table is not None:
                row, n = req_row(req), committed_len(req)
                total_prefix = kwargs.get("total_prefix_len")
                prefix = kwargs.get("prefix_len") or 0
                if row is None or n is None or (total_prefix is not None and total_prefix > prefix):
                    # HiCache fills part of the row later: recorded at its first decode step.
                    return out
                table.record_row(req, row, n)
        except Exception as exc:  # noqa: BLE001 - a record failure must not kill the scheduler
            log.error("kvguard page_generation: recording rid=%s failed: %s", getattr(req, "rid", "?"), exc)
        return out

    return _pre_alloc


def _abort_request_object(req, finished_reason: dict):
    from sglang.srt.managers import scheduler as scheduler_mod

    make = getattr(scheduler_mod, "_make_abort_req", None)
    if make is not None:
        return make(req, finished_reason=finished_reason)
    from sglang.srt.managers.io_struct import AbortReq

    return AbortReq(finished_reason=finished_reason, rid=req.rid)


def _send_abort(sched, req, finished_reason: dict) -> None:
    """Tell the tokenizer manager, the way upstream reports a request it ends outside the
    output stream (retract-abort in ``update_running_batch``)."""
    obj = _abort_request_object(req, finished_reason)
    if hasattr(sched, "send_abort_output"):  # 0.5.2x
        sched.send_abort_output(obj, req)
    elif hasattr(sched, "ipc_channels"):  # 0.5.13+
        sched.ipc_channels.send_to_tokenizer.send_output(obj, req)
    else:
        sched.send_to_tokenizer.send_output(obj, req)


def _is_radix(tree) -> bool:
    """Decode's radix cache is on (``--disaggregation-decode-enable-radix-cache``)."""
    return tree is not None and not getattr(tree, "disable", True) and type(tree).__name__ != "ChunkCache"


def _shared_prefix_slots(sched, req, table: GenerationTable) -> int:
    """Page slots at the head of the row that belong to decode's radix cache (not ours to free).

    The larger of the request's protected length (``kv.cache_protected_len``, 0.5.19+:
    upstream's own "not this request's to free") and its matched prefix
    (``prefix_indices``; 0.5.22+ no longer keep it on the request): when unsure,
    leave a page to the cache rather than free a page the cache still holds."""
    if not _is_radix(getattr(sched, "tree_cache", None)):
        return 0
    n = 0
    for holder in (getattr(req, "kv", None), req):
        v = getattr(holder, "cache_protected_len", None) if holder is not None else None
        if isinstance(v, int):
            n = max(n, v)
    prefix = getattr(req, "prefix_indices", None)
    if prefix is not None:
        n = max(n, len(prefix))
    return -(-n // table.page_size)


def _unlock_prefix(sched, req) -> bool:
    """Give back the failed request's lock on its prefix in decode's radix cache (the
    prefix pages stay in the cache, evictable again), the way upstream does when a
    request ends: ``unlock(req.lock)`` from 0.5.22, ``dec_lock_ref(req.last_node)`` before."""
    tree = getattr(sched, "tree_cache", None)
    if not _is_radix(tree):
        return False
    lock = getattr(req, "lock", None)
    if lock is not None and hasattr(tree, "unlock"):
        tree.unlock(lock)
        req.lock = None
        return True
    node = getattr(req, "last_node", None)
    if node is not None and hasattr(tree, "dec_lock_ref") and not hasattr(tree, "unlock"):
        tree.dec_lock_ref(node)
        req.last_node = None
        return True
    return False


def release_failed(sched, req, table: GenerationTable, bad_pages) -> int:
    """Free what the failed request still owns: its pages whose generation matches, and
    its row; give back its lock on a shared radix-cache prefix.

    Returns the number of pages freed. Pages that changed owner are never freed here."""
    import torch

    row = req_row(req)
    pages = table.recorded_pages(row)
    skip = _shared_prefix_slots(sched, req, table)
    bad = set(bad_pages)
    own = sorted({p for s, p in enumerate(pages) if s >= skip and p not in bad and p > 0})
    alloc = sched.token_to_kv_pool_allocator
    if own:
        ps = table.page_size
        alloc.free(torch.tensor(own, dtype=torch.int64, device=table.req_to_token.device) * ps)
    table.rec_len[row] = 0
    table.row_epoch.pop(row, None)
    sched.req_to_token_pool.free(req)
    try:
        _unlock_prefix(sched, req)
    except Exception as exc:  # noqa: BLE001 - the prefix then stays locked (resident), as before
        log.error("kvguard page_generation: unlocking rid=%s's radix-cache prefix failed (it stays resident): %s",
                  getattr(req, "rid", "?"), exc)
    return len(own)


def fail_mismatched(sched, batch, indices: List[int], table: GenerationTable) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from ..engine import metrics

    failed = [batch.reqs[i] for i in indices]
    details = {id(r): table.detail(req_row(r)) for r in failed}
    keep = [i for i in range(len(batch.reqs)) if i not in set(indices)]
    batch.filter_batch(keep_indices=keep)
    for req in failed:
        detail = details[id(req)]
        shown = "; ".join(f"page {p}: recorded generation {r}, now {c}" for _, p, r, c in detail[:8])
        more = " ..." if len(detail) > 8 else ""
        message = (f"kvguard: {len(detail)} KV page(s) of this request were freed or handed to another request "
                   f"while it still used them ({shown}{more}); failed closed before decode read them")
        room = getattr(req, "bootstrap_room", None)
        log.error("kvguard page_generation: request rid=%s room=%s failed closed: %s",
                  getattr(req, "rid", "?"), room, message)
        metrics.count("generation_mismatches")
        table.stats["mismatches"] += 1
        reason = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVGuardPageGenerationMismatch")
        req.finished_reason = reason
        freed = 0
        try:
            freed = release_failed(sched, req, table, [p for _, p, _, _ in detail])
        except Exception as exc:  # noqa: BLE001 - leak rather than free what is not ours
            log.error("kvguard page_generation: releasing rid=%s failed (its pages stay allocated): %s",
                      getattr(req, "rid", "?"), exc)
        log.info("kvguard page_generation: rid=%s released %d page(s) it still owned; %d page(s) that changed "
                 "owner were left to their new owner", getattr(req, "rid", "?"), freed, len(detail))
        _send_abort(sched, req, reason.to_json())


def checked_insert(table: GenerationTable, reqs, insert: Callable[[], object]):
    """Run ``insert`` (the radix insert that may rewrite rows) between a check and a record.

    Before: the requests' records are checked; a request with a mismatch is barred from
    the radix cache (its pages may belong to another request now) and keeps its old
    records, so the next batch check fails it closed. After: every other request's row
    is recorded again, following any rewrite the insert did (prefix dedup)."""
    live = [r for r in reqs if not r.finished() and req_row(r) is not None]
    bad: set = set()
    if live:
        try:
            for i in table.mismatched(live):
                bad.add(id(live[i]))
                live[i].skip_radix_cache_insert = True
                log.error("kvguard page_generation: rid=%s has a page that changed owner before its prefix was "
                          "cached; it is kept out of the radix cache and fails at the next batch check",
                          getattr(live[i], "rid", "?"))
        except Exception as exc:  # noqa: BLE001 - a check that cannot run must not kill the scheduler
            from ..engine import metrics

            metrics.count("generation_check_errors")
            log.error("kvguard page_generation: the check before the radix insert failed: %s", exc)
    out = insert()
    if live:
        try:
            table.record_rows([r for r in live if id(r) not in bad])
        except Exception as exc:  # noqa: BLE001
            log.error("kvguard page_generation: recording rows after the radix insert failed: %s", exc)
    return out


def _process_prebuilt(original: Callable) -> Callable:
    def process_prebuilt(self, *args, **kwargs):
        table = table_of(getattr(self, "token_to_kv_pool_allocator", None))
        if table is None or not getattr(self, "reqs", None) or not _is_radix(getattr(self, "tree_cache", None)):
            return original(self, *args, **kwargs)  # without the radix cache no row is rewritten here
        return checked_insert(table, list(self.reqs), lambda: original(self, *args, **kwargs))

    return process_prebuilt


def _update_running_batch(original: Callable) -> Callable:
    def update_running_batch(self, batch, *args, **kwargs):
        table = table_of(getattr(self, "token_to_kv_pool_allocator", None))
        if table is None or batch is None or not getattr(batch, "reqs", None):
            return original(self, batch, *args, **kwargs)
        live = [i for i, r in enumerate(batch.reqs) if not r.finished() and req_row(r) is not None]
        if live:
            try:
                bad = table.mismatched([batch.reqs[i] for i in live])
            except Exception as exc:  # noqa: BLE001 - a check that cannot run must not kill the scheduler
                from ..engine import metrics

                metrics.count("generation_check_errors")
                log.error("kvguard page_generation: the batch check failed (this step is not verified): %s", exc,
                          exc_info=not _warned["check"])
                _warned["check"] = True
                bad = []
            if bad:
                fail_mismatched(self, batch, [live[i] for i in bad], table)
        out = original(self, batch, *args, **kwargs)
        res = out if out is not None else batch
        try:
            if getattr(res, "reqs", None) and getattr(res, "seq_lens", None) is not None \
                    and len(res.seq_lens) == len(res.reqs) and all(req_row(r) is not None for r in res.reqs):
                table.extend(res.reqs, res.seq_lens)
        except Exception as exc:  # noqa: BLE001
            log.error("kvguard page_generation: recording the step's new pages failed: %s", exc)
        return out

    return update_running_batch


# ----------------------------------------------------------------------------- start-up


def _scheduler_init(original: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if pd_role(self) != ROLE:
            return
        alloc = getattr(self, "token_to_kv_pool_allocator", None)
        r2t = getattr(self, "req_to_token_pool", None)
        if alloc is None or r2t is None or not hasattr(r2t, "req_to_token"):
            return
        table = bind(alloc, r2t)
        if table is not None:
            tree = getattr(self, "tree_cache", None)
            radix = _is_radix(tree)
            log.info(
                "kvguard page_generation: decode pages carry generation tags (%d pages, page size %d); every "
                "decode batch is checked against its requests' records before the forward%s",
                table.gens.numel() - 1, table.page_size,
                f"; rows rewritten by the radix cache ({type(tree).__name__}) are recorded again" if radix else "",
            )

    return __init__


class PageGenerationGuard(Guard):
    name = "page_generation"
    suspendable = True  # hybrid_pool_check may switch it off on a node it cannot cover (warn)
    protects = "decode never reads a KV page that was freed or handed to another request after it recorded it"
    targets = (SCHEDULER_INIT, PAGED_FREE, PAGED_RELEASE, TOKEN_FREE, PRE_ALLOC, PROCESS_PREBUILT,
               UPDATE_RUNNING_BATCH)

    def decide(self, ctx) -> Decision:
        patches = [SCHEDULER_INIT.key, TOKEN_FREE.key, PRE_ALLOC.key, PROCESS_PREBUILT.key, UPDATE_RUNNING_BATCH.key]
        patches.append(PAGED_RELEASE.key if ctx.has(PAGED_RELEASE.key) else PAGED_FREE.key)
        for key in patches:
            ctx.require(key)
        sink = "_release_page_ids" if PAGED_RELEASE.key in patches else "free"
        return Decision(ACTIVE, f"generation bumped at the free sink ({sink}); checked before every decode batch",
                        patches=tuple(patches))

    def wrappers(self, ctx) -> Dict[str, Callable[[Callable], Callable]]:
        return {
            SCHEDULER_INIT.key: _scheduler_init,
            PAGED_FREE.key: _paged_free,
            PAGED_RELEASE.key: _paged_release,
            TOKEN_FREE.key: _token_free,
            PRE_ALLOC.key: _pre_alloc,
            PROCESS_PREBUILT.key: _process_prebuilt,
            UPDATE_RUNNING_BATCH.key: _update_running_batch,
        }
