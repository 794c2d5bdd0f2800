"""mooncake_batch_bound with a real Mooncake transfer engine over TCP on loopback.

Two of SGLang's own ``MooncakeTransferEngine`` objects (sender and receiver) in this
process, numpy buffers registered with them, and SGLang's real
``MooncakeKVManager._transfer_data`` called with 3000 blocks. The manager itself
is a stand-in holding only ``engine`` (its constructor needs a whole scheduler).
"""

from __future__ import annotations

import os
import types

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

BLOCK = 64
N_BLOCKS = 3000


class CountingEngine:
    """Delegates to the real engine and records each batch's size."""

    def __init__(self, real):
        self.real = real
        self.batches = []

    def batch_transfer_sync(self, session_id, buffers, peer_addresses, lengths):
        self.batches.append(len(buffers))
        return self.real.batch_transfer_sync(session_id, buffers, peer_addresses, lengths)


@pytest.fixture(scope="module")
def engines():
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    np = pytest.importorskip("numpy")
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    sender = MooncakeTransferEngine("127.0.0.1")
    receiver = MooncakeTransferEngine("127.0.0.1")
    src = np.random.default_rng(7).integers(0, 255, N_BLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    sender.register(src.ctypes.data, src.nbytes)
    receiver.register(dst.ctypes.data, dst.nbytes)
    return sender, receiver, src, dst


def _blocks(src, dst):
    # reversed destination order: every block is its own (src, dst, len) triple
    return [
        (src.ctypes.data + i * BLOCK, dst.ctypes.data + (N_BLOCKS - 1 - i) * BLOCK, BLOCK)
        for i in range(N_BLOCKS)
    ]


def _expected(src):
    return src.reshape(N_BLOCKS, BLOCK)[::-1].reshape(-1)


def test_guard_splits_batches_and_every_byte_lands(engines, monkeypatch):
    import sglang_kvguard
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    sender, receiver, src, dst = engines
    dst[:] = 0
    monkeypatch.setenv("KVGUARD_MAX_TRANSFER_BATCH", "1024")
    report = sglang_kvguard.install()
    try:
        assert {g.name: g.state for g in report.guards}["mooncake_batch_bound"] == "active"
        spy = CountingEngine(sender)
        ret = MooncakeKVManager._transfer_data(types.SimpleNamespace(engine=spy), receiver.get_session_id(), _blocks(src, dst))
        assert ret == 0
        assert spy.batches == [1024, 1024, 952]
        assert (dst == _expected(src)).all()
        # small batches go through untouched, in one call
        spy.batches.clear()
        assert MooncakeKVManager._transfer_data(types.SimpleNamespace(engine=spy), receiver.get_session_id(), _blocks(src, dst)[:10]) == 0
        assert spy.batches == [10]
    finally:
        sglang_kvguard.uninstall()


def test_a_failed_batch_stops_the_rest(engines, monkeypatch):
    import sglang_kvguard
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    sender, receiver, src, dst = engines

    class FailSecond(CountingEngine):
        def batch_transfer_sync(self, *a):
            self.batches.append(len(a[1]))
            return -1 if len(self.batches) == 2 else self.real.batch_transfer_sync(*a)

    monkeypatch.setenv("KVGUARD_MAX_TRANSFER_BATCH", "1000")
    sglang_kvguard.install()
    try:
        spy = FailSecond(sender)
        ret = MooncakeKVManager._transfer_data(types.SimpleNamespace(engine=spy), receiver.get_session_id(), _blocks(src, dst))
        assert ret == -1
        assert spy.batches == [1000, 1000]
    finally:
        sglang_kvguard.uninstall()


def test_without_the_guard_one_unbounded_batch(engines):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    sender, receiver, src, dst = engines
    spy = CountingEngine(sender)
    ret = MooncakeKVManager._transfer_data(types.SimpleNamespace(engine=spy), receiver.get_session_id(), _blocks(src, dst))
    assert spy.batches == [N_BLOCKS]
    # Observed with mooncake-transfer-engine-non-cuda 0.3.13.post1 over TCP: the one
    # 3000-block batch is refused ("TCP lane queue-full rejection"), ret == -1, while
    # the same blocks in bounded batches all land (test above).
    print("unbounded 3000-block batch returned", ret)
