"""The SPIN model's counterexamples, replayed step by step against SGLang's real components.

``models/pd_transfer.pml`` (docs/design/formal-model.md) names each action after the
function kvguard patches, so a counterexample reads as a sequence of real hook calls.
This module ties the model to the code (issue 19):

1. The trails come from the model itself: for the release family of the installed
   SGLang, every run ``scripts/check-model.sh`` expects to end in a counterexample on
   unguarded SGLang (0.5.19 family: the incident for isolation and for "never 200", the
   late write into a reused page; 0.5.23 family: the source page reused under a
   transfer, the 500 instead of the 400, the deferred release's timeout under a late
   write) is searched again by spin/gcc/pan with the script's own switches and flags,
   replayed with ``spin -t -p`` and trimmed by the script's ``trim_trail``
   (``_model_trail.py``).
2. Each trail is replayed, one model action after the other, on real SGLang objects of
   the installed release, in this process: both nodes' real pools, paged allocators,
   metadata buffers and PD queues, built as the schedulers build them, with the Mooncake
   backend: real ``MooncakeKVManager`` s (a real bootstrap server, ZMQ handshakes,
   ``MooncakeKVSender`` / ``MooncakeKVReceiver``, the real transfer worker and
   ``TransferKVChunk`` s) moving the KV bytes over a real Mooncake engine over TCP on
   loopback. The test plays what the component tier has no real object for: the router
   (it hands each request to both doors), the prefill scheduler's loop (it calls the real
   ``pop_bootstrapped``, allocates the pages with the real allocator, writes the
   request's KV where the forward would and calls the real ``send_kv_chunk``; it frees a
   failed request's pages with the real allocator), the decode scheduler's loop (it calls
   the real ``pop_preallocated`` / ``pop_transferred`` / ``resolve_deferred_releases``;
   the model's "read" is the test reading the committed request's pages) and the network
   between the engines (``Network``: each KV batch of a chunk waits until the trail lets
   it land; a batch the trail fails returns -1 at once, as Mooncake's wall-clock timeout
   on a frozen peer does, and its real write runs when the trail says the peer resumes;
   tests/server/test_late_write.py does the same through real servers).
3. Every real function named by a hook is wrapped by a recorder, installed outside
   kvguard's wrappers, and the test asserts (a) the trail's hooks occur in the real run
   in the trail's order (step by step: the hooks of one model step, one atomic action
   that may span both nodes, in any order), and (b) the outcome is the model's: without
   kvguard the property the trail violates is violated in the real run too; with kvguard
   installed (as the other component tests install it) the real run leaves the trail
   where a guard refuses, and the property holds: the request fails closed with its
   original 4xx, or the pages stay held.

Releases: 0.5.10-0.5.20 are replayed as the 0.5.19 family, 0.5.21-0.5.23 as the 0.5.23
family (``_model_trail.FAMILY_RANGES`` says why). Without spin or gcc the module skips,
unless ``KVGUARD_REQUIRE_SPIN=1`` (CI), which fails instead.

Where the real code is finer than the model, the replay says how it follows the trail:

* page choice: the model may hand out any page that is not clean; SGLang's PD allocator
  hands out a freed page only when its free list runs short. Each pool has as many pages
  as the trail uses on that node (prefill: the rest of a prompt-sized pool is held by
  another tenant; decode: plus one page of headroom that its admission needs, with the
  highest id), so the real allocator makes the trail's choices. The pages of one
  allocation are a set: SGLang hands them out lowest id first, the model in any order;
* hook names: decode reserves through ``alloc_extend`` and gives pages back through
  ``free_segment`` (0.5.19+), both counted as the model's ``..._alloc`` / ``..._free``;
  the model's per-chunk ``transfer_worker`` step is the real worker loop handing that
  chunk to ``send_kvcache``;
* after a failed batch prefill blacklists the decode's Mooncake session until the
  failed-session probe readmits it (the model has no blacklist): the probe runs every
  0.2 s here, and a chunk is sent once the session is readmitted;
* 0.5.2x prefills optimistically before decode's metadata arrives (not modelled): the
  replay pops a request after its bootstrap finished; 0.5.22+ stage the page indices in
  pinned CUDA memory, which a CPU run cannot: the sender takes them as a host array;
* both nodes live in this process, on SGLang's one process-wide Mooncake engine (its
  transfers go over TCP to itself); the managers' socket threads are made daemons so the
  process can exit.

Each guarded test fails with the guard it relies on switched off
(``KVGUARD_DISABLE=...``, read by ``sglang_kvguard.install``): admission_drain or
rejection_notice (the incident: 500, or no answer, instead of the 400),
decode_destination_hold or prefill_source_hold (the late write lands in a page another
request owns), prefill_source_hold on 0.5.21+ (the source page is handed out under its
failed batch), rejection_notice (500 after decode's wait), decode_deferred_release (the
late write lands in the next request's page; transfer_checksum then fails that request
closed, as defence in depth).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import inspect
import itertools
import os
import re
import threading
import time
import types
from http import HTTPStatus
from typing import Dict, List, Optional

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"  # this module installs and uninstalls explicitly

import _model_trail as mt  # noqa: E402

pytestmark = pytest.mark.component

PAGE = 16
PROMPT = 2 * PAGE  # the model's request: two pages, one page per chunk
PREFILL_LIMIT = PAGE  # request 1 is over prefill's limit; decode reserves its full prompt
FOREIGN = 0x5A  # another tenant's KV, left in pages nobody zeroes
STEP_WAIT = 8.0  # how long one step waits for the real system (threads, sockets)
SETTLE = 8.0  # guarded: how long the real system gets to answer a request that left the trail
SHORT_TIMEOUT = 1.0  # upstream timeouts the trail lets fire (waiting / deferred release)
LONG_TIMEOUT = 600.0  # upstream timeouts the trail does not use
_ROOMS = itertools.count(1)

HOOK_ALIASES = {
    # The model's one allocation hook stands for the paged allocator's page-handing calls:
    # with pages of 16 tokens, decode's _pre_alloc allocates through alloc_extend (both
    # are kvguard targets); the prefill replay allocates with alloc.
    "PagedTokenToKVPoolAllocator_alloc": ("alloc_extend",),
    # ... and its one free hook for the paged allocator's frees: decode's release path
    # (release_kv_cache -> the tree cache) frees a request's row with free_segment on
    # 0.5.19+, which, like free, hands the pages to the free-list sink
    "PagedTokenToKVPoolAllocator_free": ("free_segment",),
}
NOT_REPLAYED = {
    # hook -> why the component tier cannot call the real function (no real Scheduler,
    # TokenizerManager or model forward here); the test plays that part instead
    "TokenizerManager__send_one_request": "the router/tokenizer: the test hands the request to both doors",
    "TokenizerManager__validate_one_request": "the front door: no TokenizerManager here",
    "TokenizerManager_abort_request": "client aborts: no TokenizerManager here",
    "Scheduler_update_running_batch": "decode's forward: the test reads the committed request's pages",
    "SchedulerOutputStreamer_stream_output": "decode's answer: the test reads the committed request's status",
    "Scheduler_flush_cache": "no Scheduler here",
    "Scheduler_is_fully_idle": "no Scheduler here",
}
WORKER = "MooncakeKVManager_transfer_worker"


# ----------------------------------------------------------------------------- collection


def _family() -> Optional[str]:
    try:
        from packaging.version import Version

        return mt.family_for(Version(importlib.metadata.version("sglang")))
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_generate_tests(metafunc):
    if "run_id" not in metafunc.fixturenames:
        return
    fam = _family()
    runs = [r.id for r in mt.model_runs(fam)] if fam else []
    if not runs:
        runs = [pytest.param("-", marks=pytest.mark.skip(
            reason="no model family for this SGLang release: docs/design/formal-model.md models 0.5.19 and "
                   "0.5.23 as shipped, replayed here for 0.5.10-0.5.20 and 0.5.21-0.5.23"))]
    metafunc.parametrize("run_id", runs)


@pytest.fixture(scope="module")
def trails(tmp_path_factory, sgl):
    """Every unguarded counterexample of this release's family, from the model (one pan
    search each, 1-3 s)."""
    mt.require_tools(pytest)
    fam = mt.family_for(sgl.SGLANG_VERSION)
    if fam is None:
        pytest.skip(f"no model family for sglang {sgl.SGLANG_VERSION}")
    out = {}
    work = tmp_path_factory.mktemp("model")
    for run in mt.model_runs(fam):
        got = mt.produce_trail(run, work / run.id)
        out[run.id] = (run, got["trail"], mt.parse_trail(got["trail"]))
    return out


# ----------------------------------------------------------------------------- the network


class Network:
    """The wire between prefill's Mooncake engine and decode's memory, played by the test.

    Wraps prefill's real engine: a batch whose destination is a decode KV page of a chunk
    the replay knows waits until the trail decides: "land" (the real engine moves the
    bytes now) or "fail" (-1 at once, the real write kept for ``resume``). Every other
    batch (aux data, notices) goes straight through."""

    def __init__(self, real, classify):
        self._real = real
        self._classify = classify
        self._cv = threading.Condition()
        self.decisions: Dict[tuple, str] = {}
        self.seen: Dict[tuple, int] = {}
        self.deferred: Dict[tuple, list] = {}
        self.closed = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _gate(self, key, do):
        with self._cv:
            self.seen[key] = self.seen.get(key, 0) + 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: key in self.decisions or self.closed, timeout=120)
            decision = self.decisions.get(key, "fail")
        if decision == "land":
            return do()
        with self._cv:
            self.deferred.setdefault(key, []).append(do)
        return -1

    def batch_transfer_sync(self, session_id, src, dst, lengths, *a, **kw):
        key = self._classify(dst)
        do = lambda: self._real.batch_transfer_sync(session_id, src, dst, lengths, *a, **kw)  # noqa: E731
        return do() if key is None else self._gate(key, do)

    def transfer_sync(self, session_id, src, dst, length, *a, **kw):
        key = self._classify([dst])
        do = lambda: self._real.transfer_sync(session_id, src, dst, length, *a, **kw)  # noqa: E731
        return do() if key is None else self._gate(key, do)

    def decide(self, key, decision: str) -> None:
        with self._cv:
            self.decisions[key] = decision
            self._cv.notify_all()

    def wait_seen(self, key, timeout: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.seen.get(key, 0) > 0, timeout=timeout)

    def resume(self, key) -> List[int]:
        """The frozen peer resumes: the failed batches of ``key`` still write."""
        with self._cv:
            todo = self.deferred.pop(key, [])
        return [do() for do in todo]

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


# ----------------------------------------------------------------------------- the PD pair


@dataclasses.dataclass
class ModelReq:
    """One request of the trail: its prefill and decode ``Req`` (two nodes: two objects)."""

    r: int
    room: int
    rid: str
    p: object = None
    d: object = None
    entry: object = None  # decode's DecodeRequest
    prow: Optional[int] = None
    ptokens: Dict[int, object] = dataclasses.field(default_factory=dict)  # chunk -> prefill token indices
    ppages: Dict[int, int] = dataclasses.field(default_factory=dict)  # chunk -> real prefill page
    dpages: List[int] = dataclasses.field(default_factory=list)  # real decode pages, in token order
    model_dpages: List[int] = dataclasses.field(default_factory=list)  # the trail's numbers for them
    sent: Dict[int, bool] = dataclasses.field(default_factory=dict)  # chunk -> last?
    committed: bool = False  # decode committed its transfer (it runs)
    reject_msg: str = ""


def _kv_byte(r: int, c: int) -> int:
    return 0x10 * r + c + 1  # request r's KV for its page c


def _kv_buffers(pool):
    from sglang_kvguard.guards.destination_canary import kv_buffers

    return kv_buffers(pool)


def _write_page(pool, page: int, value: int) -> None:
    for buf in _kv_buffers(pool):
        buf[page * PAGE:(page + 1) * PAGE].view(-1).view(_torch().uint8).fill_(value)


def _page_bytes(pool, page: int) -> set:
    out = set()
    for buf in _kv_buffers(pool):
        out.update(int(x) for x in buf[page * PAGE:(page + 1) * PAGE].reshape(-1).view(_torch().uint8).unique())
    return out


def _owner(described: str, r: int) -> str:
    """Whose KV a page holds, for comparing a trail's line with a real page: "own",
    "canary" or "other" (another request's, or another tenant's)."""
    if described.startswith(f"r{r}'s KV"):
        return "own"
    if "canary" in described:
        return "canary"
    return "other"


def _torch():
    import torch

    return torch


def _describe(pool, page: int, reqs) -> str:
    got = _page_bytes(pool, page)
    if len(got) == 1:
        v = next(iter(got))
        if v == FOREIGN:
            return "another tenant's KV (left in the page)"
        for mr in reqs:
            for c in (0, 1):
                if v == _kv_byte(mr.r, c):
                    return f"r{mr.r}'s KV for its page {c}"
    return f"bytes {sorted(got)[:4]}{'...' if len(got) > 4 else ''} (no request's KV)"


def _free_page_ids(allocator) -> set:
    """Pages in the allocator's free list, including the ones a PD allocator keeps aside
    (``release_pages`` up to 0.5.22, ``staged_pages`` from 0.5.23)."""
    ids = set()
    for name in ("free_pages", "release_pages"):
        t = getattr(allocator, name, None)
        if t is not None:
            ids.update(int(x) for x in t.tolist())
    for t in getattr(allocator, "staged_pages", None) or ():
        ids.update(int(x) for x in t.tolist())
    return ids


def _finished(req):
    reason = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
    return reason


def _status(req) -> Optional[int]:
    reason = _finished(req)
    if reason is None:
        return None
    code = getattr(reason, "status_code", None)
    return int(code) if code is not None else None


def _message(req) -> str:
    reason = _finished(req)
    return str(getattr(reason, "message", "") or "")


def _real_door_hand_back(sch) -> None:
    """0.5.21+: upstream's PD door hands a rejected request to
    ``Scheduler.retire_unadmitted_request`` (kvguard's rejection notice wraps it). The
    stand-in gets the real method (looked up at each call, so wrappers apply), with the two
    scheduler parts it touches: no beam groups, and the real ``_release_aborted_request``."""
    from sglang.srt.managers.scheduler import Scheduler

    if not hasattr(Scheduler, "retire_unadmitted_request"):
        return
    retired = sch.retired_unadmitted

    def retire_unadmitted_request(req, *args, **kwargs):
        retired.append(req)
        return Scheduler.retire_unadmitted_request(sch, req, *args, **kwargs)

    sch.retire_unadmitted_request = retire_unadmitted_request
    sch.beam_coordinator = types.SimpleNamespace(retire_group=lambda req: None)  # no beam search here
    if hasattr(Scheduler, "_release_aborted_request"):
        sch._release_aborted_request = lambda req: Scheduler._release_aborted_request(sch, req)


@contextlib.contextmanager
def _daemon_threads():
    """The Mooncake managers' socket threads (bootstrap_thread, decode_thread) are not
    daemons: a scheduler process is killed, but this test process must exit. While the
    managers are built, the threads they start are daemons; nothing else changes."""
    import threading as real

    from sglang.srt.disaggregation.common import conn as common_conn
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn

    class DaemonThread(real.Thread):
        def __init__(self, *args, **kwargs):
            kwargs["daemon"] = True
            super().__init__(*args, **kwargs)

    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.Thread = DaemonThread
    saved = [(m, m.threading) for m in (common_conn, mooncake_conn) if getattr(m, "threading", None) is real]
    for m, _ in saved:
        m.threading = proxy
    try:
        yield
    finally:
        for m, t in saved:
            m.threading = t


@contextlib.contextmanager
def _only(owner, attr: str, keep):
    """Let a real queue method see only the entries ``keep`` selects (the others count as
    not ready yet: the real queues skip requests whose bootstrap or transfer is pending)."""
    full = list(getattr(owner, attr))
    others = [x for x in full if not keep(x)]
    setattr(owner, attr, [x for x in full if keep(x)])
    try:
        yield
    finally:
        rest = list(getattr(owner, attr))
        seen = {id(x) for x in others}
        setattr(owner, attr, others + [x for x in rest if id(x) not in seen])


def _pools_for(steps) -> Dict[str, int]:
    """Pages per node: as many as the trail's distinct pages on that node, so that the real
    allocator, which hands out a freed page only when no other page is free, makes the
    trail's choices (the model's allocation may take any page that is not clean)."""
    pages = {"prefill": set(), "decode": set()}
    for s in steps:
        for line in s.lines:
            for m in re.finditer(r"prefill page (\d+)", line):
                pages["prefill"].add(int(m.group(1)))
            for m in re.finditer(r"decode page (\d+)", line):
                pages["decode"].add(int(m.group(1)))
            for m in re.finditer(r"pages (\d+),(\d+)", line):
                node = "prefill" if "prefill page" in line and "decode" not in line else "decode"
                pages[node].update((int(m.group(1)), int(m.group(2))))
    # prefill's door admits a prompt no longer than its pool: pages the trail does not use
    # are held by another tenant's request for the whole run ("prefill" - "prefill_used").
    # decode admits a request only with room for its prompt and its first output token
    # (pop_preallocated): one more page, with the highest id, which the allocator hands
    # out last
    used = max(len(pages["prefill"]), 1)
    return {"prefill": max(used, -(-PROMPT // PAGE)), "prefill_used": used,
            "decode": max(len(pages["decode"]), 2) + 1}


class PDPair:
    """Prefill and decode of the installed release in this process, Mooncake backend."""

    def __init__(self, sgl, stack: contextlib.ExitStack, pages: Dict[str, int], env: Dict[str, str],
                 recorder: mt.Recorder, guarded: bool, monkeypatch):
        self.sgl = sgl
        self.recorder = recorder
        self.guarded = guarded
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        self._one_rank_world(monkeypatch)
        self.engine = self._engine()
        self.port = stack.enter_context(self._bootstrap_server())
        self.p = self._side(stack, "prefill", pages["prefill"])
        self.d = self._side(stack, "decode", pages["decode"])
        self.pm = self.p.bootstrap_queue.kv_manager
        self.dm = self.d.prealloc_queue.kv_manager
        for mgr in (self.pm, self.dm):
            stack.callback(self._deregister, mgr)
        if guarded:
            self._bind_like_scheduler_init()
        self.chunk_of_dpage: Dict[int, tuple] = {}
        self.net = Network(self.pm.engine, self._classify)
        self.pm.engine = self.net
        stack.callback(self._quiesce)
        self.sent_done: Dict[tuple, int] = {}
        self.sending = 0  # send_kvcache calls in progress
        self._sent_cv = threading.Condition()
        self._watch_send_kvcache()
        for side in (self.p, self.d):  # pages are never zeroed: another tenant's KV is there
            for pg in range(1, pages[side.mode] + 1):
                _write_page(side.kv_pool, pg, FOREIGN)
        extra = pages["prefill"] - pages["prefill_used"]
        self.filler = self.p.allocator.alloc(extra * PAGE) if extra else None
        assert extra == 0 or self.filler is not None

    # -- construction
    @staticmethod
    def _one_rank_world(monkeypatch):
        """What model-parallel initialisation sets up for one rank (tp/pp/dp = 1)."""
        import _sglang_components as sgl

        from sglang.srt.distributed import parallel_state as pstate
        from sglang.srt.layers import dp_attention as dpa

        for name, value in (("_ATTN_DP_SIZE", 1), ("_ATTN_DP_RANK", 0), ("_LOCAL_ATTN_DP_SIZE", 1),
                            ("_LOCAL_ATTN_DP_RANK", 0), ("_ATTN_TP_SIZE", 1), ("_ATTN_TP_RANK", 0)):
            if hasattr(dpa, name) and getattr(dpa, name) is None:
                monkeypatch.setattr(dpa, name, value)
        group = sgl.gloo_group()
        coord = types.SimpleNamespace(world_size=1, rank_in_group=0, rank=0, ranks=[0], local_rank=0,
                                      cpu_group=group, device_group=group, is_first_rank=True, is_last_rank=True)
        for name in ("_TP", "_PP", "_ATTN_TP", "_ATTN_CP", "_MOE_TP", "_MOE_EP", "_WORLD"):
            if hasattr(pstate, name) and getattr(pstate, name) is None:
                monkeypatch.setattr(pstate, name, coord)

    @staticmethod
    def _engine():
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

        engine = mte.get_mooncake_transfer_engine()
        if engine is None:  # what parallel_state does for a PD node with the Mooncake backend
            engine = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        return engine

    @contextlib.contextmanager
    def _bootstrap_server(self):
        """SGLang's real bootstrap server (after kvguard's install, which marks its route)."""
        server, port = self.sgl.start_bootstrap_server()
        try:
            yield port
        finally:
            server.close()

    def _side(self, stack, mode: str, pages: int):
        sgl = self.sgl
        from sglang.srt.disaggregation.utils import TransferBackend

        server_args = stack.enter_context(sgl.sglang_config(
            disaggregation_mode=mode, disaggregation_transfer_backend="mooncake", page_size=PAGE,
            disaggregation_bootstrap_port=self.port, host="127.0.0.1"))
        side = sgl.make_pd_side(mode, server_args=server_args, page_size=PAGE, num_tokens=pages * PAGE)
        # a PD node's allocator keeps freed pages aside until its free list runs out
        # (ModelRunner: need_sort = disaggregation_mode in ("decode", "prefill"))
        side.allocator.need_sort = True
        # the queue's admission limit: the prompt fits (the pool is sized to the trail's pages)
        limit = max(pages * PAGE, PROMPT)
        common = dict(req_to_metadata_buffer_idx_allocator=side.metadata_allocator,
                      metadata_buffers=side.metadata_buffers, tp_rank=0, tp_size=1, dp_size=1, gpu_id=0, pp_rank=0,
                      pp_size=1, bootstrap_port=self.port, gloo_group=sgl.gloo_group(), max_total_num_tokens=limit,
                      scheduler=side.scheduler, transfer_backend=TransferBackend.MOONCAKE,
                      draft_token_to_kv_pool=None)
        with _daemon_threads():
            self._queues(side, mode, common)
        return side

    def _queues(self, side, mode: str, common: dict) -> None:
        sgl = self.sgl
        if mode == "prefill":
            from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

            metrics = None
            if "scheduler_stage_metrics" in inspect.signature(PrefillBootstrapQueue.__init__).parameters:
                metrics = sgl._stage_metrics()
            side.bootstrap_queue = sgl.call_supported(PrefillBootstrapQueue, token_to_kv_pool=side.kv_pool,
                                                      scheduler_stage_metrics=metrics, **common)
            sch = side.scheduler
            sch.disagg_prefill_bootstrap_queue = side.bootstrap_queue
            # what send_kv_chunk reads from the real Scheduler besides the stand-in's attributes
            sch.disagg_metadata_buffers = side.metadata_buffers
            sch.disagg_prefill_pending_chunk_rids = set()
            sch.enable_staging = False
            _real_door_hand_back(sch)
        else:
            from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

            side.transfer_queue = sgl.call_supported(DecodeTransferQueue, tree_cache=side.tree_cache, **common)
            side.prealloc_queue = sgl.call_supported(
                DecodePreallocQueue, req_to_token_pool=side.req_to_token_pool,
                token_to_kv_pool_allocator=side.allocator, transfer_queue=side.transfer_queue,
                tree_cache=side.tree_cache, num_reserved_decode_tokens=0, **common)
            side.scheduler.disagg_decode_transfer_queue = side.transfer_queue
            side.scheduler.disagg_decode_prealloc_queue = side.prealloc_queue

    def _bind_like_scheduler_init(self) -> None:
        """What kvguard's ``Scheduler.__init__`` wrappers do for a real scheduler (the
        component tier has none): bind each role's allocator to its page hold, and decode's
        allocator to the generation tags."""
        from sglang_kvguard.guards import page_generation
        from sglang_kvguard.lifetime.page_hold import bind_hold

        states = self.guard_states()
        q = float(os.environ.get("KVGUARD_QUARANTINE_AFTER", "300"))
        if states.get("prefill_source_hold") == "active":
            bind_hold("prefill", self.p.allocator, q)
        if states.get("decode_destination_hold") == "active" and self.sgl.SGLANG_VERSION.release[:3] < (0, 5, 21):
            bind_hold("decode", self.d.allocator, q)
        if states.get("page_generation") == "active":
            page_generation.bind(self.d.allocator, self.d.req_to_token_pool)

    @staticmethod
    def guard_states() -> Dict[str, str]:
        from sglang_kvguard.engine.runtime import installed_report

        report = installed_report()
        return {g.name: g.state for g in report.guards} if report is not None else {}

    def _deregister(self, mgr) -> None:
        """Give the engine's registrations back (the shared engine outlives this test; a
        later pool at the same address could not be registered)."""
        engine = getattr(mgr.engine, "_real", mgr.engine)
        args = mgr.kv_args
        ptrs = list(getattr(args, "kv_data_ptrs", []) or []) + list(getattr(args, "aux_data_ptrs", []) or [])
        for comp in getattr(args, "state_data_ptrs", []) or []:
            ptrs.extend(comp if isinstance(comp, (list, tuple)) else [comp])
        for ptr in ptrs:
            try:
                engine.deregister(ptr)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _classify(self, dst_addrs):
        """(r, chunk) of a batch whose destination is a decode KV page the replay sent to."""
        args = self.dm.kv_args
        for addr in dst_addrs:
            for ptr, length, item in zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens):
                if ptr <= addr < ptr + length:
                    return self.chunk_of_dpage.get((addr - ptr) // item)
        return None

    def _watch_send_kvcache(self) -> None:
        """Know when the real transfer worker is done with a chunk (send_kvcache returned)."""
        pm = self.pm
        bound = pm.send_kvcache
        sig = inspect.signature(type(pm).send_kvcache)
        pair = self

        def send_kvcache(*args, **kwargs):
            with pair._sent_cv:
                pair.sending += 1
            try:
                return bound(*args, **kwargs)
            finally:
                with pair._sent_cv:
                    pair.sending -= 1
                try:
                    dst = sig.bind(pm, *args, **kwargs).arguments["dst_kv_indices"]
                    key = pair.chunk_of_dpage.get(int(dst[0]))
                except Exception:  # noqa: BLE001
                    key = None
                with pair._sent_cv:
                    pair.sent_done[key] = pair.sent_done.get(key, 0) + 1
                    pair._sent_cv.notify_all()

        pm.send_kvcache = send_kvcache

    def _quiesce(self) -> None:
        """Before the configuration is withdrawn: batches still waiting for the trail fail
        (-1), and the transfer worker finishes every chunk it was handed (it reads the
        configuration while it sends)."""
        self.net.close()
        queues = [getattr(q, "_kvguard_inner", q) for q in getattr(self.pm, "transfer_queues", ())]
        _until(lambda: self.sending == 0 and not any(getattr(q, "_buf", ()) for q in queues), 5.0)

    def wait_sent(self, key, timeout: float) -> bool:
        with self._sent_cv:
            return self._sent_cv.wait_for(lambda: self.sent_done.get(key, 0) > 0, timeout=timeout)

    def node_of(self, hook: str, obj) -> Optional[str]:
        if obj is self.p.allocator:
            return "prefill"
        if obj is self.d.allocator:
            return "decode"
        return None


# ----------------------------------------------------------------------------- the replay


class Diverged(Exception):
    """The real run cannot take this step of the trail."""


@dataclasses.dataclass
class Violation:
    step: int
    prop: str
    text: str


def _until(cond, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(interval)


class Replay:
    """Drives the real PD pair through a trail, one model step at a time."""

    def __init__(self, pair: PDPair, run: mt.ModelRun, steps, guarded: bool, name: str):
        self.pair, self.run, self.steps, self.guarded = pair, run, steps, guarded
        self.name = name
        self.reqs: Dict[int, ModelReq] = {}
        self.dmap: Dict[int, int] = {}
        self.pmap: Dict[int, int] = {}
        self.violations: List[Violation] = []
        self.diverged: List[tuple] = []  # (step, reason)
        self.followed: List[int] = []
        self.resumed = set()
        self.late_landings = []  # (step, r, c, real decode page, its other owner, in the free list)
        self.step = 0
        self.log: List[str] = []

    # -- helpers
    def req(self, r: int) -> ModelReq:
        if r not in self.reqs:
            room = 700_000 + 100 * next(_ROOMS) + r
            self.reqs[r] = ModelReq(r, room, f"{self.name}-r{r}-{room}")
        return self.reqs[r]

    def map_pages(self, node: str, model_pages, real_pages) -> None:
        """Tie the trail's page numbers to real page ids. One allocation is taken as a set:
        the order of its pages is the allocator's (SGLang's hands out the lowest ids
        first), which the model leaves open; which pages are shared with earlier owners is
        the trail's claim and must hold."""
        mp = self.pmap if node == "prefill" else self.dmap
        model_pages, real_pages = list(model_pages), list(real_pages)
        known = {mp[m] for m in model_pages if m in mp}
        if not known <= set(real_pages):
            raise Diverged(f"the real allocator handed out {node} pages {real_pages}; the trail's pages "
                           f"{model_pages} are real pages {[mp.get(m) for m in model_pages]}")
        fresh_real = [x for x in real_pages if x not in known]
        for x in fresh_real:
            if x in mp.values():
                other = next(k for k, v in mp.items() if v == x)
                raise Diverged(f"the real allocator handed out {node} page {x} (the trail's page {other}) where the "
                               f"trail takes fresh pages {model_pages}")
        for m in [m for m in model_pages if m not in mp]:
            mp[m] = fresh_real.pop(0)

    def violate(self, prop: str, text: str) -> None:
        self.violations.append(Violation(self.step, prop, text))
        self.log.append(f"  step {self.step}: {mt._script()['prop_names'].get(prop, prop)} violated: {text}")

    def live_decode_pages(self, but: int) -> Dict[int, int]:
        """real decode page -> r, for every live reservation other than r ``but``."""
        out = {}
        for mr in self.reqs.values():
            if mr.r == but or not mr.dpages or mr.d is None or _finished(mr.d) is not None:
                continue
            for pg in mr.dpages:
                out[pg] = mr.r
        return out

    # -- driving
    def play(self) -> None:
        for step in self.steps:
            self.step = step.number
            try:
                self.do(step)
                self.followed.append(step.number)
                self.log.append(f"  step {step.number}: followed")
            except Diverged as exc:
                if not self.guarded:
                    raise AssertionError(
                        f"{self.run.id} ({self.run.property_names}, {len(self.steps)}-step trail): the real run "
                        f"(sglang {self.pair.sgl.SGLANG_VERSION}, no kvguard) left the trail at step {step.number}: "
                        f"{exc}\n{step.text()}") from None
                self.diverged.append((step.number, str(exc)))
                self.log.append(f"  step {step.number}: the real run left the trail: {exc}")

    def do(self, step) -> None:
        h = step.header
        if re.match(r"r\d+: router forwards to prefill and decode", h):
            return self.forward(step)
        m = re.match(r"r(\d+): decode @DecodePreallocQueue_pop_preallocated -> .*pages (\d+),(\d+)", h)
        if m:
            return self.pre_alloc(int(m.group(1)), (int(m.group(2)), int(m.group(3))))
        m = re.match(r"r(\d+): prefill @PrefillBootstrapQueue_pop_bootstrapped; .*chunk 0$", h)
        if m:
            self.bootstrap(int(m.group(1)))
            return self.send_chunk(step, int(m.group(1)), 0)
        m = re.match(r"r(\d+): prefill @SchedulerDisaggregationPrefillMixin_send_kv_chunk chunk 1 \(last\)", h)
        if m:
            return self.send_chunk(step, int(m.group(1)), 1)
        m = re.match(r"r(\d+): the peer resumes: chunk (\d)'s failed batch still lands", h)
        if m:
            self.resumed.add((int(m.group(1)), int(m.group(2))))
            return None
        m = re.match(r"r(\d+): @MooncakeKVManager_transfer_worker -> @MooncakeKVManager__transfer_data chunk (\d) "
                     r"lands: prefill page (\d+) -> decode page (\d+)", h)
        if m:
            return self.land(step, *map(int, m.groups()))
        m = re.match(r"r(\d+): @MooncakeKVManager__transfer_data chunk (\d) returns -1", h)
        if m:
            return self.fail_batch(step, int(m.group(1)), int(m.group(2)))
        m = re.match(r"r(\d+): decode @DecodeTransferQueue_pop_transferred: Success -> ", h)
        if m:
            return self.commit(int(m.group(1)))
        m = re.match(r"r(\d+): decode @DecodeTransferQueue_pop_transferred: waiting timeout", h)
        if m:
            return self.waiting_timeout(step, int(m.group(1)))
        m = re.match(r"r(\d+): decode @DecodeTransferQueue_resolve_deferred_releases: deferred release timed out", h)
        if m:
            return self.release_timeout(step, int(m.group(1)))
        m = re.match(r"r(\d+): decode @Scheduler_update_running_batch reads its pages (\d+), (\d+)", h)
        if m:
            return self.read(step, int(m.group(1)), (int(m.group(2)), int(m.group(3))))
        raise AssertionError(f"{self.run.id}: step {step.number} of the model's trail is an action this replay "
                             f"does not know; teach tests/component/test_model_replay.py:\n{step.text()}")

    # -- the router
    def forward(self, step) -> None:
        """Both doors, in the order the trail prints them (decode's first)."""
        from sglang.srt.managers import utils as mutils

        pair, mr = self.pair, self.req(step.req)
        common = dict(bootstrap_host="127.0.0.1", bootstrap_room=mr.room, rid=mr.rid, max_new_tokens=1)
        mr.d = pair.d.new_req(PROMPT, **common)
        mr.p = pair.p.new_req(PROMPT, **common)
        for req in (mr.d, mr.p):
            req.bootstrap_port = pair.port
        pair.d.prealloc_queue.add(mr.d)
        if not any(e.req is mr.d for e in pair.d.prealloc_queue.queue):
            raise Diverged(f"decode's door did not queue r{mr.r}")
        rejected = [d for d in step.details if "@validate_input_length rejects" in d]
        if rejected:
            # what Scheduler.handle_generate_request does with a prompt over prefill's limit
            mr.reject_msg = mutils.validate_input_length(mr.p, PREFILL_LIMIT, False)
            assert mr.reject_msg, "the prompt should be over prefill's limit"
            mr.p.set_finish_with_abort(mr.reject_msg)
        pair.p.bootstrap_queue.add(mr.p, pair.p.kv_pool.head_num)
        queued = mr.p in pair.p.bootstrap_queue.queue
        if rejected and "one-token stub" in rejected[0]:
            if not queued:
                raise Diverged(f"prefill's door withdrew the rejected r{mr.r} ({_status(mr.p)}: {_message(mr.p)})")
            if len(mr.p.origin_input_ids) != 1:
                raise Diverged(f"the rejected r{mr.r} is not the one-token stub")
        elif rejected:  # 0.5.23's door: dropped with its 400
            if queued or _status(mr.p) != HTTPStatus.BAD_REQUEST:
                raise Diverged(f"prefill's door did not drop the rejected r{mr.r} with 400 (queued={queued})")
        elif not queued:
            raise Diverged(f"prefill's door did not queue r{mr.r} ({_status(mr.p)}: {_message(mr.p)[:200]})")

    # -- decode
    def pre_alloc(self, r: int, model_pages) -> None:
        pair, mr = self.pair, self.req(r)
        q = pair.d.prealloc_queue
        if not any(e.req is mr.d for e in q.queue):
            raise Diverged(f"r{r} is not in decode's prealloc queue ({_status(mr.d)}: {_message(mr.d)[:120]})")
        got = []

        def attempt():
            with _only(q, "queue", lambda e: e.req is mr.d):
                res = q.pop_preallocated()
            pre, failed = (res if isinstance(res, tuple) else (res, []))
            for e in pre:
                got.append(e)
            if failed:
                raise Diverged(f"decode failed r{r} while reserving: {_status(mr.d)}: {_message(mr.d)[:160]}")
            return bool(got) or _finished(mr.d) is not None

        # a reservation that cannot happen (every page held) is not waited for long
        need = -(-PROMPT // PAGE)
        short = self.guarded and len(_free_page_ids(pair.d.allocator)) < need
        if not _until(attempt, 1.5 if short else STEP_WAIT):
            raise Diverged(f"decode could not reserve pages for r{r} ({len(_free_page_ids(pair.d.allocator))} page(s) "
                           f"in its free list; the others are held)")
        if not got:
            raise Diverged(f"decode finished r{r} instead of reserving ({_status(mr.d)}: {_message(mr.d)[:160]})")
        mr.entry = got[0]
        pair.d.transfer_queue.extend(got)  # what the decode scheduler does with them
        row = pair.d.req_to_token_pool.req_to_token[pair.sgl.req_pool_idx(mr.d)][:PROMPT]
        mr.dpages = [int(x) // PAGE for x in row[::PAGE].tolist()]
        for c, real in enumerate(mr.dpages):
            pair.chunk_of_dpage[real] = (r, c)
        self.map_pages("decode", model_pages, mr.dpages)
        mr.model_dpages = list(model_pages)

    def _pop_transferred_until(self, mr: ModelReq, done, timeout: float):
        tq = self.pair.d.transfer_queue
        out = []

        def attempt():
            with _only(tq, "queue", lambda e: e.req is mr.d):
                out.extend(tq.pop_transferred())
            return done()

        return _until(attempt, timeout), out

    def commit(self, r: int) -> None:
        mr = self.req(r)
        if mr.entry is None or not any(e.req is mr.d for e in self.pair.d.transfer_queue.queue):
            raise Diverged(f"r{r} is not in decode's transfer queue ({_status(mr.d)}: {_message(mr.d)[:160]})")
        left = lambda: not any(e.req is mr.d for e in self.pair.d.transfer_queue.queue)  # noqa: E731
        ok, out = self._pop_transferred_until(mr, left, STEP_WAIT)
        if not ok:
            raise Diverged(f"decode's transfer of r{r} did not end")
        if mr.d not in out:
            raise Diverged(f"decode did not commit r{r}: {_status(mr.d)}: {_message(mr.d)[:200]}")
        mr.committed = True

    def _answered(self, mr: ModelReq, detail_lines) -> None:
        for d in detail_lines:
            m = re.match(r"=> client r(\d+) gets HTTP (\d+)", d)
            if m and int(m.group(1)) == mr.r:
                want = int(m.group(2))
                if want != 200 and _status(mr.d) != want and not self.guarded:
                    raise Diverged(f"r{mr.r} got {_status(mr.d)} where the trail answers {want}")
        self._check_fidelity(mr)

    def _check_fidelity(self, mr: ModelReq) -> None:
        if not mr.reject_msg or _status(mr.d) is None:
            return
        if _status(mr.d) != HTTPStatus.BAD_REQUEST:
            self.violate("PROP_FID4XX", f"the rejected r{mr.r} got {_status(mr.d)} ({_message(mr.d)[:160]!r}), not "
                                        f"its own 400 ({mr.reject_msg[:80]!r})")

    def waiting_timeout(self, step, r: int) -> None:
        mr = self.req(r)
        if not any(e.req is mr.d for e in self.pair.d.transfer_queue.queue):
            raise Diverged(f"r{r} already left decode's transfer queue ({_status(mr.d)}: {_message(mr.d)[:160]})")
        left = lambda: not any(e.req is mr.d for e in self.pair.d.transfer_queue.queue)  # noqa: E731
        ok, out = self._pop_transferred_until(mr, left, SHORT_TIMEOUT + STEP_WAIT)
        if not ok:
            raise Diverged(f"decode's waiting timeout did not fail r{r}")
        if self.guarded and _status(mr.d) == HTTPStatus.BAD_REQUEST and "timeout" not in _message(mr.d).lower():
            raise Diverged(f"decode aborted r{r} with prefill's 400 before its waiting timeout")
        self._answered(mr, step.details)
        self._decode_release(mr, "\n".join(step.details))

    def _decode_release(self, mr: ModelReq, details: str) -> None:
        """A trail line "@..._free: decode pages a,b of rN" after a failure: the decode
        scheduler's loop gives them back (0.5.21+: ``resolve_deferred_releases`` once the
        room drained; before, pop_transferred already did)."""
        if not re.search(r"@PagedTokenToKVPoolAllocator_free: decode pages \d+,\d+ of r%d" % mr.r, details):
            return
        tq, alloc = self.pair.d.transfer_queue, self.pair.d.allocator

        def attempt():
            if hasattr(tq, "resolve_deferred_releases"):
                tq.resolve_deferred_releases()
            return set(mr.dpages) <= _free_page_ids(alloc)

        if not _until(attempt, 1.0 if self.guarded else STEP_WAIT) and not self.guarded:
            raise Diverged(f"decode did not give r{mr.r}'s pages {mr.dpages} back "
                           f"(free: {sorted(_free_page_ids(alloc))})")

    def release_timeout(self, step, r: int) -> None:
        """0.5.23's deferred release gives the pages back when its timeout passes."""
        mr, tq, alloc = self.req(r), self.pair.d.transfer_queue, self.pair.d.allocator

        def attempt():
            tq.resolve_deferred_releases()
            return set(mr.dpages) <= _free_page_ids(alloc)

        if not _until(attempt, SHORT_TIMEOUT + (2.0 if self.guarded else STEP_WAIT)):
            raise Diverged(f"decode kept r{r}'s pages {mr.dpages} past the deferred release's timeout (held)")

    def read(self, step, r: int, model_pages) -> None:
        """The decode forward over the committed request's pages, and its answer."""
        pair, mr = self.pair, self.req(r)
        if not mr.committed or _finished(mr.d) is not None:
            raise Diverged(f"r{r} is not running on decode ({_status(mr.d)}: {_message(mr.d)[:160]})")
        self.map_pages("decode", model_pages, mr.dpages)
        seen = [f"decode page {pg}: {_describe(pair.d.kv_pool, pg, self.reqs.values())}" for pg in mr.dpages]
        self.log.extend(f"    {s}" for s in seen)
        if not self.guarded:
            # whose KV each page holds, as a multiset over the reservation (page order is the
            # allocator's, see map_pages)
            lines = [re.match(r"decode page \d+ holds (.*)", d) for d in step.details]
            want = sorted(_owner(m.group(1), r) for m in lines if m)
            got = sorted(_owner(_describe(pair.d.kv_pool, pg, self.reqs.values()), r) for pg in mr.dpages)
            if want and want != got:
                raise Diverged(f"r{r}'s pages hold {got}; the trail says {want} ({'; '.join(seen)})")
        wrong = [pg for c, pg in enumerate(mr.dpages) if _page_bytes(pair.d.kv_pool, pg) != {_kv_byte(r, c)}]
        if wrong:  # committed, no abort: upstream decodes over these pages and answers 200
            self.violate("PROP_ISOLATION", f"r{r} is committed and reads {'; '.join(seen)}")
        if mr.reject_msg:
            self.violate("PROP_FID200", f"the rejected r{r} ({mr.reject_msg[:60]!r}) is committed with no abort: "
                                        f"its client gets 200")

    # -- prefill
    def bootstrap(self, r: int) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        pair, mr = self.pair, self.req(r)
        q = pair.p.bootstrap_queue
        if mr.p not in q.queue:
            raise Diverged(f"r{r} is not in prefill's bootstrap queue ({_status(mr.p)}: {_message(mr.p)[:160]})")
        # the trail's prefill pops a request after decode's metadata reached it (0.5.2x could
        # also prefill optimistically, before it: not the order of this trail)
        sender = mr.p.disagg_kv_sender
        waited = _until(lambda: sender.poll() in (KVPoll.WaitingForInput, KVPoll.Failed),
                        1.5 if mr.entry is None else STEP_WAIT)
        if not waited or sender.poll() == KVPoll.Failed:
            raise Diverged(f"prefill's bootstrap of r{r} with decode did not finish ({sender.poll()!r}; decode "
                           f"{'reserved no pages for it' if mr.entry is None else 'sent its metadata'})")
        got = []

        def attempt():
            with _only(q, "queue", lambda x: x is mr.p):
                res = q.pop_bootstrapped()
            got.extend(res[0] if isinstance(res, tuple) else res)
            return bool(got) or mr.p not in q.queue

        if not _until(attempt, STEP_WAIT) or mr.p not in got:
            raise Diverged(f"prefill did not bootstrap r{r} ({_status(mr.p)}: {_message(mr.p)[:160]})")

    def _extend(self, mr: ModelReq, start: int, end: int):
        """The prefill scheduler's part of one chunk: a req_to_token row, pages from the
        real allocator, and the forward's KV written into them."""
        pair, req = self.pair, mr.p
        r2t, alloc = pair.p.req_to_token_pool, pair.p.allocator
        if mr.prow is None:
            params = inspect.signature(r2t.alloc).parameters
            if "reqs" in params:
                r2t.alloc([req])
            else:
                req.req_pool_idx = r2t.alloc(1)[0]
            mr.prow = pair.sgl.req_pool_idx(req)
        need = -(-(end - start) // PAGE) * PAGE
        loc = alloc.alloc(need)
        if loc is None:
            raise Diverged(f"prefill's allocator has no page for r{mr.r} ({len(_free_page_ids(alloc))} free; the "
                           f"others are held)")
        r2t.write((mr.prow, slice(start, end)), loc[: end - start])
        if hasattr(req, "set_extend_range"):
            req.set_extend_range(start, end)
        elif "extend_end" in vars(req):
            req.extend_end = end
        elif "fill_len" in vars(req):  # 0.5.13-0.5.14: fill_ids is a view of the first fill_len tokens
            req.fill_len = end
        else:
            req.fill_ids = list(req.origin_input_ids[:end]) + list(req.output_ids)
        return loc

    def send_chunk(self, step, r: int, c: int) -> None:
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as mixin

        pair, mr = self.pair, self.req(r)
        if c > 0 and c - 1 not in mr.sent:
            raise Diverged(f"r{r}'s chunk {c - 1} was never sent")
        stub = any(d.startswith("stub: one token") for d in step.details)
        last = c == 1 or stub
        n = len(mr.p.origin_input_ids)
        start, end = (0, min(PAGE, n)) if c == 0 else (PAGE, n)
        m = re.search(r"@PagedTokenToKVPoolAllocator_alloc prefill page (\d+)", "\n".join(step.details))
        pending = self.pending_source_pages()
        loc = self._extend(mr, start, end)
        page = int(loc[0]) // PAGE
        if page in pending:
            other = pending[page]
            self.violate("PROP_REUSE_SRC", f"prefill page {page} handed to r{r} while r{other[0]}'s chunk {other[1]} "
                                           f"(failed, still running) will read it")
        mr.ptokens[c], mr.ppages[c] = loc, page
        if m:
            self.map_pages("prefill", [int(m.group(1))], [page])
        _write_page(pair.p.kv_pool, page, _kv_byte(r, c))  # the forward writes r's KV for this position
        if last:
            mr.p.output_ids.append(17)  # the first output token, which the last chunk's aux carries
        sender = mr.p.disagg_kv_sender
        if getattr(sender, "supports_host_tensor_indices", False) and not _torch().cuda.is_available():
            # 0.5.22+ stage the page indices in pinned memory and a CUDA event for the
            # transfer worker; without a GPU the sender takes them as a host array, the
            # path every other backend takes (the same page indices reach the worker)
            sender.supports_host_tensor_indices = False
        blacklisted = getattr(pair.pm, "failed_sessions", None)
        if blacklisted and not _until(lambda: not pair.pm.failed_sessions, STEP_WAIT):
            raise Diverged(f"prefill still blacklists decode's Mooncake session ({sorted(pair.pm.failed_sessions)}): "
                           f"r{r}'s chunk would fail")
        sch = pair.p.scheduler
        if hasattr(mixin, "_send_kv_chunk"):
            sch._send_kv_chunk = types.MethodType(mixin._send_kv_chunk, sch)
        mixin.send_kv_chunk(sch, mr.p, last_chunk=last)
        mr.sent[c] = last
        m = re.search(r"chunk \d -> decode page (\d+)", "\n".join(step.details))
        if m and mr.dpages and self.dmap.get(int(m.group(1))) not in mr.dpages:
            raise Diverged(f"the trail sends r{r}'s chunk {c} to decode page {m.group(1)}, not one of r{r}'s real "
                           f"pages {mr.dpages}")

    def pending_source_pages(self) -> Dict[int, tuple]:
        """prefill page -> (r, c) of chunks whose batch may still read it."""
        out = {}
        for key in list(self.pair.net.deferred) + [k for k in self.pair.net.seen if k not in self.pair.net.decisions]:
            mr = self.reqs.get(key[0])
            if mr is not None and key[1] in mr.ppages:
                out[mr.ppages[key[1]]] = key
        return out

    def prefill_release(self, mr: ModelReq) -> None:
        """The prefill scheduler gives a finished or failed request's pages back (its
        release paths end in the allocator's free)."""
        for c, loc in sorted(mr.ptokens.items()):
            self.pair.p.allocator.free(loc)
        mr.ptokens.clear()
        self.pair.sgl.release_metadata_slot(self.pair.p, mr.p)

    # -- the transfer engine
    def land(self, step, r: int, c: int, model_src: int, model_dst: int) -> None:
        pair, mr = self.pair, self.req(r)
        key = (r, c)
        if c not in mr.sent:
            raise Diverged(f"r{r}'s chunk {c} was never sent")
        self.map_pages("prefill", [model_src], [mr.ppages[c]])
        if self.dmap.get(model_dst) not in mr.dpages:
            raise Diverged(f"the trail lands r{r}'s chunk {c} in decode page {model_dst}, not one of r{r}'s real "
                           f"pages {mr.dpages}")
        if key in self.resumed:  # the failed batch still writes, now
            self.resumed.discard(key)
            if not pair.net.deferred.get(key):
                raise Diverged(f"r{r}'s chunk {c} has no failed batch left to land")
            rets = pair.net.resume(key)
            dst = mr.dpages[c]
            owner = self.live_decode_pages(but=r).get(dst)
            self.late_landings.append((self.step, r, c, dst, owner, dst in _free_page_ids(pair.d.allocator)))
            self.log.append(f"    the late batch of r{r} chunk {c} landed in decode page {dst} (ret {rets}); "
                            f"now {_describe(pair.d.kv_pool, dst, self.reqs.values())}")
            if owner is not None and _page_bytes(pair.d.kv_pool, dst) == {_kv_byte(r, c)}:
                self.violate("PROP_LATEWRITE", f"r{r}'s failed batch landed in decode page {dst}, which r{owner} owns")
            self._check_details(step, r)
            return
        if not pair.net.wait_seen(key, STEP_WAIT):
            raise Diverged(f"the transfer worker never sent r{r}'s chunk {c}")
        pair.net.decide(key, "land")
        if not pair.wait_sent(key, STEP_WAIT):
            raise Diverged(f"the transfer worker did not finish r{r}'s chunk {c}")
        if mr.sent[c]:
            self._room_ends(mr, "Success", step)
        self._check_details(step, r)

    def _room_ends(self, mr: ModelReq, how: str, step) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        want = KVPoll.Success if how == "Success" else KVPoll.Failed
        if not _until(lambda: self.pair.pm.check_status(mr.room) == want, STEP_WAIT):
            raise Diverged(f"prefill's status of r{mr.r} is {self.pair.pm.check_status(mr.room)}, not {how}")
        if how == "Success" and any("prefill inflight queue frees its source pages" in d for d in step.details):
            self.prefill_release(mr)

    def _check_details(self, step, r: int) -> None:
        if self.guarded:
            return
        for d in step.details:
            m = re.match(r"prefill page (\d+) holds (.*)", d)
            if m and int(m.group(1)) in self.pmap:
                # what the batch read: it has landed in the chunk's decode page
                key = next((k for k, v in self.req(r).ppages.items() if v == self.pmap[int(m.group(1))]), None)
                if key is not None and self.req(r).dpages:
                    got = _describe(self.pair.d.kv_pool, self.req(r).dpages[key], self.reqs.values())
                    if got != m.group(2):
                        raise Diverged(f"the batch from prefill page {m.group(1)} delivered {got}; the trail says "
                                       f"{m.group(2)}")

    def fail_batch(self, step, r: int, c: int) -> None:
        """The peer is frozen: Mooncake gives up on the batch (-1) while its write still runs."""
        pair, mr = self.pair, self.req(r)
        key = (r, c)
        if c not in mr.sent:
            raise Diverged(f"r{r}'s chunk {c} was never sent")
        if not pair.net.wait_seen(key, STEP_WAIT):
            raise Diverged(f"the transfer worker never sent r{r}'s chunk {c}")
        pair.net.decide(key, "fail")
        if not pair.wait_sent(key, STEP_WAIT):
            raise Diverged(f"the transfer worker did not finish r{r}'s chunk {c}")
        details = "\n".join(step.details)
        if "@CommonKVManager_update_status r%d Failed" % r in details:
            self._room_ends(mr, "Failed", step)
        if re.search(r"@PagedTokenToKVPoolAllocator_free: prefill page \d+ of r%d" % r, details):
            self.prefill_release(mr)
            free = _free_page_ids(pair.p.allocator)
            if not self.guarded and not set(mr.ppages.values()) <= free:
                raise Diverged(f"prefill's free did not give r{r}'s page(s) {sorted(mr.ppages.values())} back "
                               f"(free: {sorted(free)})")
        if "decode @DecodeTransferQueue_pop_transferred polls Failed" in details:
            left = lambda: not any(e.req is mr.d for e in pair.d.transfer_queue.queue)  # noqa: E731
            ok, _ = self._pop_transferred_until(mr, left, STEP_WAIT)
            if not ok:
                raise Diverged(f"decode did not fail r{r}")
            self._answered(mr, step.details)
            self._decode_release(mr, details)
            free = _free_page_ids(pair.d.allocator)
            if re.search(r"decode pages \d+,\d+ of r%d freed at once" % r, details) and not self.guarded:
                if not set(mr.dpages) <= free:
                    raise Diverged(f"decode did not free r{r}'s pages {mr.dpages} at once (free: {sorted(free)})")
            if re.search(r"@DecodeTransferQueue__defer_release: pages \d+,\d+ of r%d held" % r, details):
                if set(mr.dpages) & free:
                    raise Diverged(f"decode freed r{r}'s pages {sorted(set(mr.dpages) & free)} (the trail holds them)")

    # -- the end
    def settle(self) -> None:
        """Guarded: give requests that left the trail their answer from the real system
        (a notice, a timeout) before the outcome is judged."""
        pair = self.pair
        for mr in self.reqs.values():
            if not mr.reject_msg or _finished(mr.d) is not None:
                continue
            tq, pq = pair.d.transfer_queue, pair.d.prealloc_queue

            def attempt():
                if any(e.req is mr.d for e in pq.queue):
                    with _only(pq, "queue", lambda e: e.req is mr.d):
                        res = pq.pop_preallocated()
                    pre = res[0] if isinstance(res, tuple) else res
                    tq.extend(pre)
                if any(e.req is mr.d for e in tq.queue):
                    with _only(tq, "queue", lambda e: e.req is mr.d):
                        tq.pop_transferred()
                return _finished(mr.d) is not None

            _until(attempt, SETTLE, 0.05)
            self._check_fidelity(mr)


# ----------------------------------------------------------------------------- the tests


def _env_for(steps) -> Dict[str, str]:
    text = "\n".join(s.text() for s in steps)
    return {
        "MC_FORCE_TCP": "1",
        "MOONCAKE_PROTOCOL": "tcp",
        # the upstream timeouts a trail lets fire are short here; the others never fire
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(int(SHORT_TIMEOUT if "waiting timeout" in text else LONG_TIMEOUT)),
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT":
            str(int(SHORT_TIMEOUT if "deferred release timed out" in text else LONG_TIMEOUT)),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(int(LONG_TIMEOUT)),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(int(LONG_TIMEOUT)),
        # after a failed batch prefill blacklists the decode session until its failed-session
        # probe (0.5.19+; on by default from 0.5.23, every 30 s) finds the peer again; the
        # model has no blacklist, so the probe runs often here
        "SGLANG_ENABLE_FAILED_SESSION_PROBE": "1",
        "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.2",
    }


def _trail_hooks(steps, only=None):
    """(step, [(hook, node)]) to look for among the real calls, for the steps ``only``
    names (default: all); the landing of a failed batch is the same Mooncake call as its
    failure (the batch is not sent again)."""
    out, unknown, late = [], set(), set()
    for s in steps:
        m = re.match(r"r(\d+): the peer resumes: chunk (\d)", s.header)
        if m:
            late.add((int(m.group(1)), m.group(2)))
        hooks = []
        for hook, node in s.hooks():
            if hook in NOT_REPLAYED:
                continue
            if mt.resolve_hook(hook) is None:
                unknown.add(hook)
                continue
            hooks.append((hook, node))
        lm = re.match(r"r(\d+): @MooncakeKVManager_transfer_worker -> @MooncakeKVManager__transfer_data chunk (\d)",
                      s.header)
        if lm and (int(lm.group(1)), lm.group(2)) in late:
            hooks = [h for h in hooks if h[0] not in (WORKER, "MooncakeKVManager__transfer_data")]
        if only is None or s.number in only:
            out.append((s.number, hooks))
    return out, unknown


@contextlib.contextmanager
def _replay(sgl, run, steps, guarded: bool, monkeypatch, name: str):
    """Build the pair (kvguard first, then the recorder, then the nodes), yield a Replay."""
    import sglang_kvguard
    from sglang_kvguard.lifetime import peer_liveness, transfer_drain
    from sglang_kvguard.lifetime.page_hold import HOLDS

    from sglang_kvguard.guards import prefill_source_hold

    # a background peer probe would release held pages on its own schedule: probed by hand only
    monkeypatch.setattr(peer_liveness, "WATCH", peer_liveness.PeerWatch(interval=3600.0, autostart=False))
    # an allocation that comes up short while pages are held waits for them to drain (5 s);
    # in these trails nothing drains before the step that allocates, so waiting is not shortened
    # by more than the wait itself: 0.5 s keeps the module cheap
    monkeypatch.setattr(prefill_source_hold, "ALLOC_WAIT", 0.5)
    transfer_drain.reset()
    with contextlib.ExitStack() as stack:
        if guarded:
            sglang_kvguard.install()
            stack.callback(HOLDS.clear)
            stack.callback(sglang_kvguard.uninstall)
        holder = {}
        recorder = mt.Recorder(lambda hook, obj: holder["pair"].node_of(hook, obj) if "pair" in holder else None)
        hooks = {h for s in steps for h, _ in s.hooks() if h not in NOT_REPLAYED}
        recorder.install(hooks | {WORKER}, HOOK_ALIASES, worker_step=WORKER)
        stack.callback(recorder.uninstall)
        pair = PDPair(sgl, stack, _pools_for(steps), _env_for(steps), recorder, guarded, monkeypatch)
        holder["pair"] = pair
        replay = Replay(pair, run, steps, guarded, name)
        replay.recorder = recorder
        try:
            yield replay
        finally:
            transfer_drain.reset()


def _report(replay, extra: str = "") -> str:
    calls = replay.recorder.calls
    lines = [f"{replay.run.id} on sglang {replay.pair.sgl.SGLANG_VERSION} "
             f"({'kvguard installed' if replay.guarded else 'no kvguard'}), property: {replay.run.property_names}, "
             f"{len(replay.steps)}-step trail", *replay.log]
    if replay.guarded:
        lines.append(f"  guard states: {PDPair.guard_states()}")
    lines.append("  real hook calls: " + ", ".join(f"{c.hook}{'/' + c.node if c.node else ''}" for c in calls[:80]))
    return "\n".join(lines + ([extra] if extra else []))


def _assert_trail_order(replay) -> None:
    """(a): the hooks of the steps the real run took occur among its real calls, in the
    trail's order (every step, without kvguard)."""
    hooks, unknown = _trail_hooks(replay.steps, set(replay.followed))
    assert not unknown, (f"{replay.run.id}: the trail names hooks with no real function on sglang "
                         f"{replay.pair.sgl.SGLANG_VERSION}: {sorted(unknown)}")
    got = mt.match_steps(hooks, replay.recorder.calls)
    step = next((s for s in replay.steps if s.number == got.step), None)
    assert got.ok, (f"{replay.run.id} ({replay.run.property_names}, {len(replay.steps)}-step trail): the real calls "
                    f"do not contain step {got.step}'s hooks {list(got.missing)} after the earlier steps' calls\n"
                    f"{step.text() if step else ''}\n{_report(replay)}")


def test_unguarded_release_violates_the_property(sgl, trails, run_id, monkeypatch, torch_alloc_kernels):
    """Without kvguard the real components follow the model's counterexample to its end,
    call the hooks it names in its order, and break the property it breaks."""
    run, text, steps = trails[run_id]
    with _replay(sgl, run, steps, False, monkeypatch, run_id) as replay:
        replay.play()
        _assert_trail_order(replay)
        last = steps[-1].number
        prop = run.props[0]
        hits = [v for v in replay.violations if v.prop == prop]
        assert hits, (f"{run.id}: the real run followed all {len(steps)} steps of the trail but did not break "
                      f"{run.property_names}\n{_report(replay)}")
        assert any(v.step == last for v in hits), (
            f"{run.id}: {run.property_names} broke at step(s) {[v.step for v in hits]}, the trail breaks it at step "
            f"{last}\n{_report(replay)}")
        print(_report(replay))


# What each guarded replay must end with, per property (docs/design/formal-model.md: the
# guards that stop each unguarded counterexample)
GUARDED = {
    "PROP_ISOLATION": "no committed request reads another request's KV",
    "PROP_FID200": "the rejected request is never answered 200: it gets its own 400",
    "PROP_FID4XX": "the rejected request gets its own 400 (prefill's message), promptly",
    "PROP_LATEWRITE": "the failed batch lands only in pages no other request owns (they are held)",
    "PROP_REUSE_SRC": "a source page a failed batch may still read is held, not handed out",
}


def test_guarded_release_keeps_the_property(sgl, trails, run_id, monkeypatch, torch_alloc_kernels):
    """With kvguard installed the real run leaves the model's trail where a guard refuses
    (the door withdraws the request, pages stay held), follows it up to there, and the
    property holds: the request fails closed with its own error, or waits on held pages."""
    run, text, steps = trails[run_id]
    prop = run.props[0]
    with _replay(sgl, run, steps, True, monkeypatch, run_id) as replay:
        replay.play()
        replay.settle()
        _assert_trail_order(replay)
        report = _report(replay)
        want = f"expected: {GUARDED[prop]}"
        broken = [v for v in replay.violations if v.prop == prop]
        assert not broken, (f"{run.id} with kvguard: {run.property_names} broken at step {broken[0].step} of the "
                            f"{len(steps)}-step trail: {broken[0].text}; {want}\n{report}")
        assert replay.diverged, (f"{run.id} with kvguard: the real run followed all {len(steps)} steps of the "
                                 f"counterexample; no guard refused; {want}\n{report}")
        rejected = [mr for mr in replay.reqs.values() if mr.reject_msg]
        if prop in ("PROP_FID200", "PROP_FID4XX", "PROP_ISOLATION") and rejected:
            for mr in rejected:  # fail closed with the original reason
                assert _status(mr.d) == HTTPStatus.BAD_REQUEST and mr.reject_msg in _message(mr.d), (
                    f"{run.id} with kvguard ({run.property_names}, {len(steps)}-step trail): the rejected r{mr.r} "
                    f"ended with {_status(mr.d)} {_message(mr.d)[:200]!r} on decode, not prefill's own 400 "
                    f"({mr.reject_msg!r}); {want}\n{report}")
        if prop == "PROP_LATEWRITE" or (prop == "PROP_ISOLATION" and not rejected):
            assert replay.late_landings, f"{run.id} with kvguard: the failed batch never landed; {want}\n{report}"
            for step_no, r, c, dst, owner, free in replay.late_landings:
                assert owner is None and not free, (
                    f"{run.id} with kvguard ({run.property_names}): r{r}'s late batch landed at step {step_no} of "
                    f"{len(steps)} in decode page {dst}, {f'owned by r{owner}' if owner else 'a free page'}, not a "
                    f"held one; {want}\n{report}")
        if prop == "PROP_REUSE_SRC":
            pending = replay.pending_source_pages()
            free = _free_page_ids(replay.pair.p.allocator)
            assert pending and not set(pending) & free, (
                f"{run.id} with kvguard ({run.property_names}, {len(steps)}-step trail): the source pages of the "
                f"failed batches {pending} are {'in the free list' if pending else 'gone'}; {want}\n{report}")
        print(report)
