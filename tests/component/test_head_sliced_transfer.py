"""Head-sliced transfers (MHA, prefill and decode at different attention TP) fail closed.

Everything on the decode side is SGLang's own code on CPU: the real
``DecodePreallocQueue`` / ``DecodeTransferQueue`` (built by ``_sglang_components``) with a
real ``MooncakeKVManager`` (decode mode, real Mooncake TCP engine on loopback) in place of
the fake backend's manager, and the queue's transfer backend set to Mooncake, so the
queue itself creates a real ``MooncakeKVReceiver`` for a request addressed to a prefill
on loopback. The prefill side is SGLang's real ``CommonKVBootstrapServer`` with P
prefill ranks registered with the JSON a real prefill rank PUTs to ``/route`` (each a
ZMQ PULL socket that receives decode's real registration and metadata messages). The
queue resolves the prefill's parallel info through the real
``try_ensure_parallel_info`` (GET ``/route``, ``PrefillServerInfo``,
``_resolve_rank_mapping``) and the real ``CommonKVReceiver.init``, then reserves pages
and runs the real ``send_metadata`` under kvguard's wrappers. The transfer's completion
is what decode's Mooncake thread records when prefill reports success
(``kv_mgr.update_status(room, KVPoll.Success)``), plus the aux row and pages it would
land; then ``pop_transferred`` commits through kvguard's commit wrappers.

Test-side inputs that a real server takes elsewhere: decode's own attention TP size
(``kv_mgr.attn_tp_size``, from the parallel state a real scheduler initialises; set on
the real manager for the decode-TP-2 case) and SGLang's dp-attention globals (set to one
rank, as ``initialize_dp_attention`` would on a single-rank decode).

Upstream's Mooncake manager starts non-daemon threads (decode and heartbeat threads on
0.5.10-0.5.19), so the scenario runs in a child process that exits with ``os._exit``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["KVGUARD_AUTO_INSTALL"] = "0"

pytestmark = pytest.mark.component

HERE = Path(__file__).resolve().parent
PROMPT = 40
PAGE = 16

# (name, prefill attn TP, decode attn TP, MLA model)
CASES = [
    ("mha-p2-d1", 2, 1, False),
    ("mha-p1-d2", 1, 2, False),
    ("mha-p2-d2", 2, 2, False),
    ("mha-p1-d1", 1, 1, False),
    ("mla-p2-d1", 2, 1, True),
    ("mla-p1-d2", 1, 2, True),
]


# ------------------------------------------------------------------------------------
# child process
# ------------------------------------------------------------------------------------
def _register(port: int, tp_size: int, rank_ports) -> None:
    import urllib.request

    for tp_rank, rank_port in enumerate(rank_ports):
        body = dict(attn_tp_size=tp_size, attn_tp_rank=tp_rank, attn_cp_size=1, attn_cp_rank=0,
                    attn_dp_size=1, attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=1,
                    system_dp_rank=0, rank_ip="127.0.0.1", rank_port=rank_port, page_size=PAGE,
                    kv_cache_dtype="auto", load_balance_method="follow_bootstrap_room")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/route", data=json.dumps(body).encode(),
                                     method="PUT", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200


def _bootstrap(sgl, tp_size: int):
    import zmq

    server, port = sgl.start_bootstrap_server()
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(tp_size):
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.LINGER, 0)
        socks.append((s, s.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32000)))
    _register(port, tp_size, [p for _, p in socks])
    return server, port, socks


def _one_case(sgl, prefill_tp: int, decode_tp: int, mla: bool, room: int) -> dict:
    import torch
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    from sglang_kvguard.guards import destination_canary as dc
    from sglang_kvguard.guards import transfer_checksum as tcs
    from sglang_kvguard.guards import transfer_coverage as tcov

    server, port, socks = _bootstrap(sgl, prefill_tp)
    fields = dict(disaggregation_mode="decode", disaggregation_transfer_backend="fake", page_size=PAGE)
    with sgl.torch_alloc_kernels() as shims, sgl.sglang_config(**fields) as server_args:
        kw = {"kv_pool": sgl.make_mla_pool} if mla else {}
        d = sgl.make_pd_side("decode", server_args=server_args, page_size=PAGE, **kw)
        d.kernel_shims = shims
        q = d.prealloc_queue
        assert bool(q.is_mla_backend) == mla
        kv_args = q.kv_manager.kv_args  # the real KVArgs the queue built (see _child for 0.5.10-0.5.11)
        mgr = get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)(
            kv_args, DisaggregationMode.DECODE, server_args, q.is_mla_backend)
        mgr.attn_tp_size = decode_tp  # a decode rank (engine rank 0) of a decode with this attention TP
        q.kv_manager = mgr
        q.transfer_backend = TransferBackend.MOONCAKE

        req = d.new_req(PROMPT, bootstrap_room=room)
        req.bootstrap_host, req.bootstrap_port = "127.0.0.1", port
        q.add(req)
        preallocated, failed = q.pop_preallocated()
        preallocated = list(preallocated)
        assert not failed and [dr.req for dr in preallocated] == [req], (preallocated, failed)
        dreq = preallocated[0]
        receiver = dreq.kv_receiver
        out = {
            "receiver": type(receiver).__name__,
            "prefill_info_attn_tp": getattr(getattr(receiver, "prefill_info", None), "attn_tp_size", None),
            "mgr_attn_tp": mgr.attn_tp_size,
            "stamped": getattr(receiver, "_kvguard_canary", None) is not None,
            "recorded": getattr(receiver, "_kvguard_checksum", None) is not None,
        }
        # what the transfer lands: every reserved page, the aux row with prefill's publications
        row = d.req_to_token_pool.req_to_token[sgl.req_pool_idx(req)][:PROMPT]
        pages = [int(x) // PAGE for x in row[::PAGE].tolist()]
        gen = torch.Generator().manual_seed(room)
        for buf in dc.kv_buffers(d.kv_pool):
            for p in pages:
                chunk = buf[p * PAGE:(p + 1) * PAGE]
                chunk.copy_(torch.randn(chunk.shape, generator=gen).to(chunk.dtype))
        idx = dreq.metadata_buffer_index
        d.metadata_buffers.bootstrap_room[idx][0] = room
        tcov.publish(d.metadata_buffers.cached_tokens[idx], len(req.origin_input_ids), len(pages))
        tcs.publish(d.metadata_buffers.cached_tokens[idx], tcs.digest(d.kv_pool, pages, room), len(pages))
        mgr.update_status(room, KVPoll.Success)  # decode's Mooncake thread, on prefill's success
        d.transfer_queue.extend(preallocated)
        transferred = d.transfer_queue.pop_transferred()
        reason = req.finished_reason
        out.update(
            committed=[r is req for r in transferred] == [True],
            status=getattr(reason, "status_code", None),
            message=getattr(reason, "message", None) if reason is not None else None,
            received=sum(1 for s, _ in socks if s.poll(2000)),
        )
    server.close()
    return out


def _child(cases_json: str, env_json: str) -> None:
    """Runs in the child: install kvguard with ``env``, run ``cases``, print JSON, os._exit."""
    out = {}
    try:
        os.environ.update(json.loads(env_json))
        os.environ["MC_FORCE_TCP"] = "1"
        os.environ["MOONCAKE_PROTOCOL"] = "tcp"
        sys.path.insert(0, str(HERE))
        import logging

        import _sglang_components as sgl
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
        from sglang.srt.layers import dp_attention as dpa

        import sglang_kvguard

        # one dp-attention rank, as initialize_dp_attention leaves a single-rank decode
        for k, v in dict(_ATTN_DP_SIZE=1, _ATTN_DP_RANK=0, _ATTN_TP_SIZE=1, _ATTN_TP_RANK=0,
                         _LOCAL_ATTN_DP_SIZE=1, _LOCAL_ATTN_DP_RANK=0).items():
            if hasattr(dpa, k) and getattr(dpa, k) is None:
                setattr(dpa, k, v)
        mte.init_mooncake_transfer_engine("127.0.0.1")
        import inspect

        from sglang.srt.disaggregation.fake.conn import FakeKVManager

        if "self.kv_args = args" not in inspect.getsource(FakeKVManager.__init__):
            # 0.5.10-0.5.11's fake manager drops the KVArgs its queue built (conftest's
            # fake_manager_keeps_kv_args): keep them, to hand them to the Mooncake manager
            original = FakeKVManager.__init__

            def __init__(self, args, *a, **kw):
                original(self, args, *a, **kw)
                self.kv_args = args

            FakeKVManager.__init__ = __init__
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                if record.levelno >= logging.ERROR and record.name == "sglang_kvguard":
                    records.append(record.getMessage())

        logging.getLogger("sglang_kvguard").addHandler(Keep())
        report = sglang_kvguard.install()
        out["states"] = {g.name: g.state for g in report.guards}
        for i, (name, p, dtp, mla) in enumerate(json.loads(cases_json)):
            out[name] = _one_case(sgl, p, dtp, mla, 91000 + i)
        out["errors_logged"] = records
    except BaseException as exc:  # noqa: BLE001 - report it to the parent
        import traceback

        out["crash"] = f"{exc!r}\n{traceback.format_exc()}"
    sys.stdout.write("\n@@RESULT@@" + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)


def _run(cases, **env) -> dict:
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_head_sliced_transfer as t; "
            f"t._child(sys.argv[1], sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases), json.dumps(env)],
                          capture_output=True, text=True, timeout=180, cwd=str(HERE.parent.parent))
    marker = "@@RESULT@@"
    assert marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.rsplit(marker, 1)[1].strip())
    assert "crash" not in out, out["crash"] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def guarded(sgl):
    return _run(CASES)


def _refused(res):
    assert not res["committed"], "decode committed a head-sliced transfer"
    assert res["status"] == 500, res
    return res["message"]


@pytest.mark.parametrize("name,p,d", [("mha-p2-d1", 2, 1), ("mha-p1-d2", 1, 2)])
def test_mha_with_different_attention_tp_fails_closed(guarded, name, p, d):
    res = guarded[name]
    assert res["receiver"] == "MooncakeKVReceiver", res
    assert (res["prefill_info_attn_tp"], res["mgr_attn_tp"]) == (p, d), res  # from SGLang's own code path
    assert res["received"] == p, res  # decode's real registration reached every prefill rank it maps to
    msg = _refused(res)
    assert f"prefill attention TP {p}, decode attention TP {d}" in msg, msg
    assert "MHA" in msg and "head-sliced" in msg, msg
    assert "--kvguard-disable destination_canary,transfer_checksum" in msg, msg
    assert "same attention TP" in msg, msg
    assert msg.count("kvguard:") == 1, msg  # one message, from the first commit check that saw it
    assert not res["stamped"] and not res["recorded"], "whole-page checks were armed for head slices"


@pytest.mark.parametrize("name", ["mha-p1-d1", "mha-p2-d2", "mla-p2-d1", "mla-p1-d2"])
def test_whole_page_transfers_are_committed(guarded, name):
    res = guarded[name]
    assert res["receiver"] == "MooncakeKVReceiver", res
    assert res["message"] is None, res["message"]
    assert res["committed"], res
    assert res["stamped"] and res["recorded"], "whole-page checks must stay armed"


def test_one_error_line_per_prefill_address(guarded):
    logged = [m for m in guarded["errors_logged"] if "cannot verify this transfer" in m]
    # two head-sliced prefill addresses in this run, one request each: one line each
    assert len(logged) == 2, guarded["errors_logged"]


def test_checksum_alone_also_fails_closed(sgl):
    out = _run([c for c in CASES if c[0] in ("mha-p2-d1", "mha-p1-d1")], KVGUARD_DISABLE="destination_canary")
    assert out["states"]["destination_canary"] == "off"
    msg = _refused(out["mha-p2-d1"])
    assert "transfer_checksum checks whole pages" in msg, msg
    assert out["mha-p1-d1"]["committed"], out["mha-p1-d1"]
