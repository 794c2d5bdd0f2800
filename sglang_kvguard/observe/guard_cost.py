"""Guard cost accounting: the guards' own time beside the scheduler's busy time.

Off by default, and then nothing here runs (no wrapper is added). With
``--kvguard-accounting=on`` (env ``KVGUARD_ACCOUNTING=on``), in every process:

* each kvguard wrapper is wrapped once more (:func:`accounted`): its elapsed time,
  minus the time of the upstream call it wraps and of any other kvguard wrapper it
  calls directly, is added to its guard's counter. Nested wrappers on one target are
  each charged their own part; the upstream code is charged to nobody;
* the scheduler's busy time is counted beside it from five upstream calls that do a
  batch's or a transfer's work in every supported release: ``Scheduler.run_batch`` and
  ``Scheduler.process_batch_result`` always, and the PD transfer steps
  (``process_decode_queue``, ``process_disagg_prefill_inflight_queue``, prefill's
  ``PrefillBootstrapQueue.pop_bootstrapped``) only when their queues hold something at
  entry. The event loop's idle polling is not busy time, so guard work done while
  polling (every iteration) counts against the guards, never for them.

Both are exported as counters, ``kvguard_guard_seconds_total{guard,phase}``,
``kvguard_guard_calls_total{guard,phase}``, per wrapped target
``kvguard_guard_target_seconds_total{guard,target}`` / ``..._calls_total``, and
``kvguard_scheduler_busy_seconds_total``, flushed
from per-process sums at most every 0.25 s by the next counted call (so a scrape may lag
by that much). ``phase`` is ``busy`` for guard time inside a busy call on the same
thread, ``outside`` for the rest (idle polling, the tokenizer, transfer threads). Guard
work done on kvguard's own background threads (notice workers) is outside wrappers and
not counted; work a wrapper does on a transfer thread is counted.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable, Dict, Optional

from ..engine.targets import target

BUSY = "accounting"  # the guard name the busy-time wrappers are applied under

RUN_BATCH = target(
    "accounting.scheduler.Scheduler.run_batch",
    "sglang.srt.managers.scheduler:Scheduler.run_batch",
    why="accounting (opt-in): a forward batch is scheduler busy time",
)
PROCESS_RESULT = target(
    "accounting.scheduler.Scheduler.process_batch_result",
    "sglang.srt.managers.scheduler:Scheduler.process_batch_result",
    why="accounting (opt-in): processing a batch's result is scheduler busy time",
)
DECODE_QUEUE = target(
    "accounting.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
    "sglang.srt.disaggregation.decode:SchedulerDisaggregationDecodeMixin.process_decode_queue",
    why="accounting (opt-in): decode's transfer step is busy time when its queues hold requests",
)
PREFILL_INFLIGHT = target(
    "accounting.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
    "sglang.srt.disaggregation.prefill:SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
    why="accounting (opt-in): prefill's transfer step is busy time when sends are in flight",
)
PREFILL_BOOTSTRAP = target(
    "accounting.prefill.PrefillBootstrapQueue.pop_bootstrapped",
    "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue.pop_bootstrapped",
    why="accounting (opt-in): prefill's bootstrap step is busy time when requests wait in it",
)

_now = time.perf_counter_ns
_tls = threading.local()
_lock = threading.Lock()
_guard_ns: Dict[tuple, int] = {}  # (guard, phase) -> ns
_guard_calls: Dict[tuple, int] = {}  # (guard, phase) -> calls
_target_ns: Dict[tuple, int] = {}  # (guard, target) -> ns
_target_calls: Dict[tuple, int] = {}
_busy = {"ns": 0, "calls": 0}
_flushed: Dict[str, float] = {}
_last_flush = [0.0]
FLUSH_EVERY_S = 0.25


def _inner() -> int:
    return getattr(_tls, "inner", 0)


def accounted(guard: str, factory: Callable[[Callable], Callable], where: str = "") -> Callable[[Callable], Callable]:
    """``factory`` (a kvguard wrapper factory) whose wrapper charges its own time to ``guard``
    (and to ``where``, the target's name, in the per-target breakdown)."""

    def make(original: Callable) -> Callable:
        def upstream(*args, **kwargs):  # the wrapped upstream call: charged to nobody
            saved = _inner()
            _tls.inner = 0
            t0 = _now()
            try:
                return original(*args, **kwargs)
            finally:
                _tls.inner = saved + (_now() - t0)

        wrapper = factory(upstream)

        @functools.wraps(wrapper)
        def timed(*args, **kwargs):
            saved = _inner()
            _tls.inner = 0
            t0 = _now()
            try:
                return wrapper(*args, **kwargs)
            finally:
                elapsed = _now() - t0
                own = elapsed - _tls.inner
                _tls.inner = saved + elapsed  # an enclosing wrapper does not pay for this one
                _add_guard(guard, own, where)

        return timed

    return make


_bias = {"ns": 0.0}


def calibrate(n: int = 20000) -> float:
    """The accounting's own cost charged to a wrapper per call (ns), measured here: an
    accounted no-op wrapper around a no-op call records its timer and bookkeeping
    overhead as guard time. Exported as ``kvguard_accounting_bias_seconds_per_call``;
    the benchmark subtracts it (times the calls) from each guard's seconds."""
    def noop():
        return None

    probe = accounted("__calibration__", lambda original: (lambda: original()))(noop)
    saved = (dict(_guard_ns), dict(_guard_calls), dict(_target_ns), dict(_target_calls))
    try:
        for _ in range(n // 10):  # warm up
            probe()
        with _lock:
            _guard_ns.pop(("__calibration__", "outside"), None)
            _guard_calls.pop(("__calibration__", "outside"), None)
        for _ in range(n):
            probe()
        with _lock:
            ns = _guard_ns.get(("__calibration__", "outside"), 0)
    finally:
        with _lock:
            for d, old in zip((_guard_ns, _guard_calls, _target_ns, _target_calls), saved):
                d.clear()
                d.update(old)
    _bias["ns"] = ns / n
    try:
        from prometheus_client import Gauge

        from ..engine import metrics as m

        if "accounting_bias" not in m._metrics:
            kwargs = {"multiprocess_mode": "max"} if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else {}
            m._metrics["accounting_bias"] = Gauge(
                "kvguard_accounting_bias_seconds_per_call",
                "the accounting's own overhead charged to a wrapper per call (subtract times the calls)", **kwargs)
        m._metrics["accounting_bias"].set(_bias["ns"] / 1e9)
    except Exception:  # noqa: BLE001
        pass
    return _bias["ns"]


def _add_guard(guard: str, ns: int, where: str = "") -> None:
    key = (guard, "busy" if getattr(_tls, "busy_depth", 0) else "outside")
    ns = max(ns, 0)
    with _lock:
        _guard_ns[key] = _guard_ns.get(key, 0) + ns
        _guard_calls[key] = _guard_calls.get(key, 0) + 1
        tk = (guard, where)
        _target_ns[tk] = _target_ns.get(tk, 0) + ns
        _target_calls[tk] = _target_calls.get(tk, 0) + 1
    _maybe_flush()


def _busy_when(has_work: Optional[Callable] = None) -> Callable[[Callable], Callable]:
    def factory(original: Callable) -> Callable:
        def busy(self, *args, **kwargs):
            depth = getattr(_tls, "busy_depth", 0)
            try:
                counts = depth == 0 and (has_work is None or bool(has_work(self)))
            except Exception:  # noqa: BLE001 - accounting never changes the scheduler's behaviour
                counts = False
            if not counts:
                return original(self, *args, **kwargs)
            _tls.busy_depth = depth + 1
            t0 = _now()
            try:
                return original(self, *args, **kwargs)
            finally:
                _tls.busy_depth = depth
                with _lock:
                    _busy["ns"] += _now() - t0
                    _busy["calls"] += 1
                _maybe_flush()

        return busy

    return factory


def _decode_has_work(sched) -> bool:
    pre = getattr(sched, "disagg_decode_prealloc_queue", None)
    tra = getattr(sched, "disagg_decode_transfer_queue", None)
    return bool(len(getattr(pre, "queue", ())) or len(getattr(tra, "queue", ())))


def _prefill_has_work(sched) -> bool:
    return bool(len(getattr(sched, "disagg_prefill_inflight_queue", ()) or ()))


def _bootstrap_has_work(queue) -> bool:
    return bool(len(getattr(queue, "queue", ()) or ()))


BUSY_TARGETS: Dict[str, Callable[[Callable], Callable]] = {
    RUN_BATCH.key: _busy_when(),
    PROCESS_RESULT.key: _busy_when(),
    DECODE_QUEUE.key: _busy_when(_decode_has_work),
    PREFILL_INFLIGHT.key: _busy_when(_prefill_has_work),
    PREFILL_BOOTSTRAP.key: _busy_when(_bootstrap_has_work),
}


def enabled(config) -> bool:
    try:
        return config.get("accounting") == "on"
    except KeyError:
        return False


def snapshot() -> dict:
    """This process's sums so far (seconds)."""
    with _lock:
        per_guard: Dict[str, float] = {}
        for (g, _), ns in _guard_ns.items():
            per_guard[g] = per_guard.get(g, 0.0) + ns / 1e9
        per_guard_calls: Dict[str, int] = {}
        for (g, _), n in _guard_calls.items():
            per_guard_calls[g] = per_guard_calls.get(g, 0) + n
        return {
            "guard_seconds": per_guard,
            "guard_seconds_by_phase": {f"{g}/{ph}": ns / 1e9 for (g, ph), ns in _guard_ns.items()},
            "guard_calls": per_guard_calls,
            "guard_calls_by_phase": {f"{g}/{ph}": n for (g, ph), n in _guard_calls.items()},
            "target_seconds": {f"{g}/{t}": ns / 1e9 for (g, t), ns in _target_ns.items()},
            "target_calls": {f"{g}/{t}": n for (g, t), n in _target_calls.items()},
            "busy_seconds": _busy["ns"] / 1e9,
            "bias_seconds_per_call": _bias["ns"] / 1e9,
            "busy_calls": _busy["calls"],
        }


def _maybe_flush() -> None:
    now = time.monotonic()
    if now - _last_flush[0] < FLUSH_EVERY_S:
        return
    _last_flush[0] = now
    try:
        flush()
    except Exception:  # noqa: BLE001 - metrics never stop the guards
        pass


def flush() -> None:
    """Move the sums into the Prometheus counters (increments since the last flush)."""
    from prometheus_client import Counter

    from ..engine import metrics as m

    if "guard_seconds" not in m._metrics:
        m._metrics["guard_seconds"] = Counter(
            "kvguard_guard_seconds", "seconds spent in kvguard's wrappers, upstream calls excluded (accounting on); "
            "phase busy: inside a scheduler busy call", ["guard", "phase"])
        m._metrics["guard_calls"] = Counter(
            "kvguard_guard_calls", "calls of kvguard's wrappers counted by the accounting (accounting on)",
            ["guard", "phase"])
        m._metrics["target_seconds"] = Counter(
            "kvguard_guard_target_seconds", "kvguard_guard_seconds per wrapped upstream target (accounting on)",
            ["guard", "target"])
        m._metrics["target_calls"] = Counter(
            "kvguard_guard_target_calls", "kvguard_guard_calls per wrapped upstream target (accounting on)",
            ["guard", "target"])
        m._metrics["busy_seconds"] = Counter(
            "kvguard_scheduler_busy_seconds",
            "scheduler seconds spent running batches, their results and non-empty PD transfer steps (accounting on)")
    snap = snapshot()
    for key, secs in snap["guard_seconds_by_phase"].items():
        g, phase = key.split("/")
        _inc(m._metrics["guard_seconds"].labels(guard=g, phase=phase), ("s", key), secs)
    for key, secs in snap["target_seconds"].items():
        g, t = key.split("/", 1)
        _inc(m._metrics["target_seconds"].labels(guard=g, target=t), ("ts", key), secs)
        _inc(m._metrics["target_calls"].labels(guard=g, target=t), ("tc", key), snap["target_calls"][key])
    for key, calls in snap["guard_calls_by_phase"].items():
        g, phase = key.split("/")
        _inc(m._metrics["guard_calls"].labels(guard=g, phase=phase), ("c", key), calls)
    _inc(m._metrics["busy_seconds"], ("busy",), snap["busy_seconds"])


def _inc(counter, key, total) -> None:
    prev = _flushed.get(key, 0.0)
    if total > prev:
        counter.inc(total - prev)
        _flushed[key] = total


def reset_for_tests() -> None:
    with _lock:
        _guard_ns.clear()
        _guard_calls.clear()
        _target_ns.clear()
        _target_calls.clear()
        _busy.update(ns=0, calls=0)
    _flushed.clear()
    _last_flush[0] = 0.0
