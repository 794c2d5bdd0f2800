"""Per-request bookkeeping of the admission, notice and coverage guards (CPU); prints JSON.

Run with a test-bed interpreter (real SGLang installed)::

    ~/.cache/kvguard-testbed/sglang-0.5.19/bin/python benchmarks/bench_bookkeeping.py

Budget (issue #22): all per-request bookkeeping of these guards together <= 50 us.
Per-call figures from the accounting trios (``bench_guard_share.py``) are wall time
on a machine whose two cores run three busy-polling processes, so they include time
descheduled (e.g. 73 us for the coverage commit against 11 us alone); this measures
each wrapper alone, on SGLang's real objects, guarded against plain in interleaved
rounds (medians):

* ``coverage_publish``: ``MetadataBuffers.set_buf`` wrapped by transfer_coverage
  (prefill, once per request), minus plain ``set_buf``;
* ``coverage_commit``: transfer_coverage's wrapper of
  ``DecodeTransferQueue._commit_transfer_to_req`` around a no-op (decode, once per
  request; the real row, ``Req`` and metadata buffers);
* ``limit_message``: ``validate_input_length`` wrapped by input_limit_message, minus
  plain (once per request);
* ``notice_status``: rejection_notice's ``update_status`` wrapper with nothing
  pending, around a no-op (prefill, a few calls per request; counted x4);
* ``admission_door_prefill`` / ``_decode``: admission_drain's doors
  (``PrefillBootstrapQueue.add`` / ``DecodePreallocQueue.add``) for an admitted
  request, around a no-op (where upstream drains itself, 0.5.21+, they are not
  installed and cost nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("KVGUARD_AUTO_INSTALL", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "component"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _meta import git_commit  # noqa: E402

BUDGET_US = 50.0
STATUS_CALLS_PER_REQUEST = 4


def _per_call(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import _sglang_components as sgl
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.managers.utils import validate_input_length

    from sglang_kvguard.guards import admission_drain, input_limit_message, rejection_notice
    from sglang_kvguard.guards import transfer_coverage as tc

    with sgl.sglang_config():
        buffers, md_alloc = sgl.make_metadata_buffers(16)
        req = sgl.make_req(600, bootstrap_host="10.0.0.1", bootstrap_room=424242)
        req.metadata_buffer_index = md_alloc.alloc()
        req.output_ids.append(17)
        req.disagg_kv_sender = types.SimpleNamespace(num_kv_indices=38)
        plain_set_buf = MetadataBuffers.set_buf
        guarded_set_buf = tc._set_buf(plain_set_buf)
        guarded_set_buf(buffers, req)  # the row now carries a published coverage
        idx = req.metadata_buffer_index
        buffers.bootstrap_room[idx][0] = req.bootstrap_room
        queue = types.SimpleNamespace(metadata_buffers=buffers)
        decode_req = types.SimpleNamespace(req=req, metadata_buffer_index=idx,
                                           kv_receiver=types.SimpleNamespace(_kvguard_reserved_pages=38))
        commit = tc._commit("fail")(lambda self, dr: None)
        assert tc.check(decode_req, buffers.cached_tokens[idx], req.bootstrap_room) is None
        limit = input_limit_message._validate(validate_input_length)
        manager = types.SimpleNamespace()
        status = rejection_notice._update_status(lambda self, room, st: None)
        door = admission_drain._prefill_door(lambda self, r: None)
        decode_door = admission_drain._decode_door(lambda self, r: None)

        cases = {
            "coverage_publish": (lambda: guarded_set_buf(buffers, req), lambda: plain_set_buf(buffers, req), 1),
            "coverage_commit": (lambda: commit(queue, decode_req), None, 1),
            "limit_message": (lambda: limit(req, 4096, False), lambda: validate_input_length(req, 4096, False), 1),
            "notice_status": (lambda: status(manager, 424242, 2), None, STATUS_CALLS_PER_REQUEST),
            "admission_door_prefill": (lambda: door(manager, req), None, 1),
            "admission_door_decode": (lambda: decode_door(manager, req), None, 1),
        }
        samples = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (guarded, plain, _n) in cases.items():
                g = _per_call(guarded, args.reps)
                p = _per_call(plain, args.reps) if plain is not None else 0.0
                samples[name].append(g - p)
    out = {"benchmark": "bench_bookkeeping", "sglang": str(sgl.SGLANG_VERSION), "commit": git_commit(),
           "cpus": os.cpu_count(), "rounds": args.rounds, "reps": args.reps,
           "per_call_us": {k: round(statistics.median(v), 2) for k, v in samples.items()},
           "calls_per_request": {k: c[2] for k, c in cases.items()}}
    total = sum(out["per_call_us"][k] * out["calls_per_request"][k] for k in cases)
    out["per_request_us"] = round(total, 2)
    out["budget_us"] = BUDGET_US
    out["within_budget"] = total <= BUDGET_US
    print(json.dumps(out))


if __name__ == "__main__":
    main()
