"""Real late reads of prefill source pages, Mooncake over TCP, with the decode peer frozen.

The prefill side is SGLang's real KV pool, paged allocator, FastQueue and
TransferKVChunk; the transfer is SGLang's real ``MooncakeKVManager._transfer_data``
on a real ``MooncakeTransferEngine``; the decode peer is a real Mooncake engine in its
own process (``_mooncake_peer.py``).

1. Request A owns 4 KV pages (pattern 0x11); the rest of the pool is taken.
2. The decode peer is frozen (SIGSTOP). A's chunk is queued; the transfer worker
   starts sending A's pages (64 MiB: each page many times) and blocks once the TCP
   buffers are full. Mooncake reads the source memory as it sends.
3. A ends while its transfer is stuck (timeout, abort): the scheduler frees its pages.
   Request B asks for 4 pages and writes its own KV (pattern 0x22) into what it gets.
4. The peer resumes (SIGCONT) and the transfer completes.

Without kvguard, B gets A's pages, and the bytes the decode peer receives for A
after the freeze are B's KV: another tenant's data, reported as a successful
transfer. With kvguard's prefill_source_hold, A's pages stay held until the worker
has drained the chunk, B gets nothing (the pool is full), every byte decode receives
is A's, and the pages come back afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

transfer_chunk = pytest.importorskip("_sglang_components").transfer_chunk  # needs torch + SGLang

PAGE = 16
A_BYTE, B_BYTE = 0x11, 0x22
TOTAL = 64 << 20  # bytes sent for A: far more than loopback TCP buffers hold
BATCH = 512


@pytest.fixture(scope="module")
def mooncake_pair(tmp_path_factory):
    pytest.importorskip("mooncake")
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    dump = tmp_path_factory.mktemp("peer") / "dump.npy"
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_mooncake_peer.py")), str(TOTAL), str(dump)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sid, addr = peer.stdout.readline().split()
        sender = MooncakeTransferEngine("127.0.0.1")
        yield types.SimpleNamespace(peer=peer, sid=sid, addr=int(addr), dump=dump, sender=sender)
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGCONT)
            peer.stdin.write("quit\n")
            peer.stdin.flush()
            try:
                peer.wait(10)
            except subprocess.TimeoutExpired:
                peer.kill()


def _peer(pair, cmd):
    pair.peer.stdin.write(cmd + "\n")
    pair.peer.stdin.flush()
    assert pair.peer.stdout.readline().strip() == "ok"


def _pages(tokens):
    return sorted({int(t) // PAGE for t in tokens.tolist()})


def _late_read_scenario(side, pair, queue):
    """Steps 1-4 of the module docstring; returns (B's pages or None, received bytes)."""
    import torch

    kbuf = side.kv_pool.k_buffer[0]
    raw = kbuf.view(-1).view(dtype=torch.uint8)
    page_bytes = raw.numel() // kbuf.shape[0] * PAGE
    pair.sender.register(kbuf.data_ptr(), raw.numel())
    try:
        return _scenario_body(side, pair, queue, kbuf, raw, page_bytes)
    finally:
        # the next test's pool may be allocated where this one was: Mooncake refuses
        # to register a region that overlaps one still registered
        pair.sender.deregister(kbuf.data_ptr())


def _scenario_body(side, pair, queue, kbuf, raw, page_bytes):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    alloc = side.allocator
    a = alloc.alloc(4 * PAGE)
    rest = alloc.alloc(alloc.available_size())  # B can only get pages that A gives back
    a_pages = _pages(a)
    for pg in a_pages:
        raw[pg * page_bytes:(pg + 1) * page_bytes] = A_BYTE
    _peer(pair, "zero")

    reps = TOTAL // (page_bytes * len(a_pages))
    result = {}

    def worker():  # SGLang's transfer worker: take a chunk, send it, take the next
        chunk = queue.get()
        blocks = []
        for r in range(reps):
            for j, pg in enumerate(chunk.prefill_kv_indices.tolist()):
                dst = pair.addr + (r * len(a_pages) + j) * page_bytes
                blocks.append((kbuf.data_ptr() + pg * page_bytes, dst, page_bytes))
        ret = 0
        for i in range(0, len(blocks), BATCH):
            ret = MooncakeKVManager._transfer_data(types.SimpleNamespace(engine=pair.sender), pair.sid, blocks[i:i + BATCH])
            if ret != 0:
                break
        result["ret"] = ret
        result["next"] = queue.get()  # done with this chunk

    os.kill(pair.peer.pid, signal.SIGSTOP)
    t = threading.Thread(target=worker, daemon=True)
    try:
        queue.put(transfer_chunk(9001, a_pages))
        t.start()
        time.sleep(1.5)
        assert t.is_alive(), "the transfer did not block on the frozen peer"
        alloc.free(a)  # A timed out / was aborted while its transfer is stuck
        b = alloc.alloc(4 * PAGE)
        b_pages = None
        if b is not None:
            b_pages = _pages(b)
            for pg in b_pages:
                raw[pg * page_bytes:(pg + 1) * page_bytes] = B_BYTE
    finally:
        os.kill(pair.peer.pid, signal.SIGCONT)
    queue.put(None)
    t.join(120)
    assert not t.is_alive() and result["ret"] == 0, result
    _peer(pair, "dump")
    received = np.load(pair.dump)[: reps * len(a_pages) * page_bytes]
    return a_pages, b, b_pages, rest, received


def test_unguarded_late_read_sends_another_requests_kv(make_side, mooncake_pair):
    from sglang.srt.disaggregation.common.utils import FastQueue

    with make_side("prefill", num_tokens=256, shape=_shape()) as p:
        a_pages, b, b_pages, rest, received = _late_read_scenario(p, mooncake_pair, FastQueue())
        assert b_pages == a_pages  # the freed pages went straight to B
        leaked = int((received == B_BYTE).sum())
        assert leaked > 0, "expected B's KV in what decode received for A"
        print(f"unguarded: {leaked} of {received.size} bytes received for A were B's KV")


def test_guarded_pages_are_never_reused_while_the_transfer_reads_them(make_side, mooncake_pair):
    import sglang_kvguard
    from sglang.srt.disaggregation.common.utils import FastQueue

    from sglang_kvguard.guards import prefill_source_hold as g
    from sglang_kvguard.lifetime.page_hold import HOLDS

    report = sglang_kvguard.install()
    try:
        assert {x.name: x.state for x in report.guards}["prefill_source_hold"] == "active"
        HOLDS.clear()
        with make_side("prefill", num_tokens=256, shape=_shape()) as p:
            hold = g.bind_allocator(p.allocator, 300.0)
            manager = type("Manager", (), {})()
            manager.transfer_queues = [FastQueue()]
            queue = g._proxy_for(manager, manager.transfer_queues[0])
            queue.consumer_wrapped = True  # what kvguard's transfer_worker wrapper does
            a_pages, b, b_pages, rest, received = _late_read_scenario(p, mooncake_pair, queue)
            assert b is None  # A's pages were held: nothing to hand out
            assert set(np.unique(received).tolist()) == {A_BYTE}  # decode got A's KV, all of it
            assert g.release_drained(p.allocator) == len(a_pages)
            assert sorted(_pages(p.allocator.alloc(4 * PAGE))) == a_pages
            assert hold.held_pages() == 0
    finally:
        sglang_kvguard.uninstall()
        HOLDS.clear()


def _shape():
    from _sglang_components import TinyModelShape

    return TinyModelShape(num_kv_heads=8, head_dim=128)  # 32 KiB per page and layer
