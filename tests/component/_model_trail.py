"""Counterexample trails of the SPIN model (models/pd_transfer.pml), read from the model.

Used by ``test_model_replay.py``. Nothing here is a copy of a trail: each trail is
produced by running spin, gcc and pan on ``models/pd_transfer.pml`` with the switches and
search flags that ``scripts/check-model.sh`` uses for that run (the ``run`` line, the
mode's ``ccflags``/``panflags`` and ``guard_defines`` are read from the script), then
replayed with ``spin -t -p`` and trimmed by the script's own ``trim_trail`` function.

* ``model_runs(family, kind)``: the runs the script expects to end in a counterexample
  for a release family (``unguarded``: SGLang as shipped);
* ``produce_trail(run, workdir)``: one pan search and its trimmed trail;
* ``parse_trail(text)``: numbered steps with the ``@Hook`` names of each;
* ``family_for(version)``: the model family a release is replayed as;
* ``Recorder``: records calls of SGLang's real functions named by hooks, in order;
* ``match_steps``: are a trail's hooks, step by step, a subsequence of the real calls.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "pd_transfer.pml"
SCRIPT = REPO / "scripts" / "check-model.sh"
PATCHES = REPO / "patches"
NICE = ["nice", "-n", "19"]  # the machine is shared with timing-sensitive jobs (check-model.sh does the same)
HOOK = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")
STEP = re.compile(r"^\s*(\d+)\.\s+(.*)$")


# ----------------------------------------------------------------------------- tools


def missing_tools() -> List[str]:
    return [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


def require_tools(pytest) -> None:
    """Skip without spin/gcc, unless KVGUARD_REQUIRE_SPIN=1 (CI), which fails instead."""
    missing = missing_tools()
    if not missing:
        return
    msg = f"{' and '.join(missing)} not on PATH (Debian: apt-get install -y spin gcc)"
    if os.environ.get("KVGUARD_REQUIRE_SPIN") == "1":
        pytest.fail(f"KVGUARD_REQUIRE_SPIN=1 but {msg}", pytrace=False)
    pytest.skip(f"{msg}; KVGUARD_REQUIRE_SPIN=1 makes this a failure")


# ----------------------------------------------------------------------------- release families


FAMILY_RANGES = (
    # (first, last, family). docs/design/formal-model.md models "SGLang 0.5.19 as shipped" and
    # "0.5.23 as shipped"; its release table reads two upstream changes that both land in 0.5.21
    # (README's guard table, docs/design/page-lifetime.md): the PD door that drops a rejected
    # prompt (admission_drain is kvguard's door on 0.5.10-0.5.20, upstream's from 0.5.21) and
    # decode's deferred release on by default (decode_destination_hold on 0.5.10-0.5.20,
    # decode_deferred_release from 0.5.21). The doc names no release in between; when this was
    # written, each family's unguarded trails were followed step by step on 0.5.10, 0.5.15 and
    # 0.5.19-0.5.20 (0.5.19 family) and on 0.5.21-0.5.23 (0.5.23 family).
    ((0, 5, 10), (0, 5, 20), "0.5.19"),
    ((0, 5, 21), (0, 5, 23), "0.5.23"),
)


def family_for(version) -> Optional[str]:
    rel = tuple(version.release[:3])
    for first, last, fam in FAMILY_RANGES:
        if first <= rel <= last:
            return fam
    return None


# ----------------------------------------------------------------------------- check-model.sh


@dataclasses.dataclass(frozen=True)
class ModelRun:
    id: str
    family: str
    guards: str
    props: Tuple[str, ...]
    mode: str
    expect: str
    kind: str
    extra: str

    @property
    def property_names(self) -> str:
        names = _script()["prop_names"]
        return ", ".join(names.get(p, p) for p in self.props)


@functools.lru_cache(maxsize=1)
def _script() -> dict:
    text = SCRIPT.read_text()
    all_guards = re.search(r'^ALL_GUARDS="([^"]*)"', text, re.M)
    modes = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r'^\s*(\w+)\)\s*ccflags="([^"]*)";\s*panflags="([^"]*)"\s*;;', text, re.M)}
    prop_names = dict(re.findall(r'\[(\w+)\]="([^"]*)"', text))
    trim = re.search(r"^trim_trail\(\) \{\n.*?^\}\n", text, re.M | re.S)
    runs = []
    run_line = (r'^\s*run\s+("?)([\w$-]+)\1\s+("?)([\d.$]+)\3\s+(none|all|"[^"]*")\s+("[^"]*"|\S+)'
                r'\s+(\w+)\s+(\w+)\s+(\w+)(?:\s+"([^"]*)")?\s*$')
    for m in re.finditer(run_line, text, re.M):
        rid, fam, guards, props, mode, expect, kind, extra = (m.group(2), m.group(4), m.group(5).strip('"'),
                                                              m.group(6).strip('"'), m.group(7), m.group(8),
                                                              m.group(9), m.group(10) or "")
        if "$" in rid or "$" in fam or "$" in props:
            continue  # runs built from loop variables: not needed here
        runs.append(ModelRun(rid, fam, guards, tuple(props.split()), mode, expect, kind, extra))
    if not (all_guards and modes and trim and runs):
        raise RuntimeError(f"{SCRIPT} no longer has the ALL_GUARDS / mode / trim_trail / run lines "
                           "tests/component/_model_trail.py reads; update it")
    return {"all_guards": all_guards.group(1).split(), "modes": modes, "prop_names": prop_names,
            "trim": trim.group(0), "runs": runs}


def model_runs(family: str, kind: str = "unguarded") -> List[ModelRun]:
    """The script's runs of ``family`` of this kind that expect a counterexample."""
    return [r for r in _script()["runs"] if r.family == family and r.kind == kind and r.expect == "violation"]


def guard_defines(spec: str) -> List[str]:
    """``guard_defines`` of check-model.sh: "none", "all", "all -X +Y" -> -D list."""
    words = spec.split()
    on = set(_script()["all_guards"]) if words[0] == "all" else set()
    for w in words[1:]:
        if w.startswith("-"):
            on.discard(w[1:])
        elif w.startswith("+"):
            on.add(w[1:])
    return [f"-D{g}" for g in _script()["all_guards"] if g in on]


def defines(run: ModelRun) -> List[str]:
    rel = {"0.5.19": "REL_0519", "0.5.23": "REL_0523"}[run.family]
    return [f"-D{rel}", *guard_defines(run.guards), *(f"-D{p}" for p in run.props), *run.extra.split()]


def produce_trail(run: ModelRun, workdir: Path, timeout: float = 300.0) -> dict:
    """spin -a, gcc, pan, spin -t -p for one run, as check-model.sh does; returns
    ``{"trail": trimmed text, "pan": pan's output, "argv": [...]}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL, workdir / "pd_transfer.pml")
    ccflags, panflags = _script()["modes"][run.mode]
    defs = defines(run)

    def sh(argv, **kw):
        cp = subprocess.run(NICE + argv, cwd=workdir, capture_output=True, text=True, timeout=timeout, **kw)
        return cp

    steps = [["spin", "-a", *defs, "pd_transfer.pml"], ["gcc", *ccflags.split(), "-o", "pan", "pan.c"]]
    for argv in steps:
        cp = sh(argv)
        if cp.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed in {workdir}:\n{cp.stdout[-3000:]}{cp.stderr[-3000:]}")
    pan = sh(["./pan", *panflags.split()]).stdout
    errors = re.findall(r"errors: (\d+)", pan)
    if not errors or errors[-1] == "0" or not re.search(r"assertion violated|claim violated|acceptance cycle", pan):
        raise RuntimeError(f"{run.id}: pan found no counterexample (check-model.sh expects one):\n{pan[-3000:]}")
    raw = sh(["spin", "-t", "-p", *defs, "pd_transfer.pml"]).stdout
    trimmed = subprocess.run(["bash", "-c", _script()["trim"] + "\ntrim_trail"], input=raw, capture_output=True,
                             text=True, timeout=60)
    if trimmed.returncode != 0 or not re.search(r"^\s*\d+\. ", trimmed.stdout or "", re.M):
        raise RuntimeError(f"{run.id}: trim_trail failed: {trimmed.stderr[-2000:]}")
    (workdir / f"{run.id}.trail.txt").write_text(trimmed.stdout)
    argv = ["spin", "-a", *defs, "pd_transfer.pml", "&&", "gcc", ccflags, "&&", "./pan", panflags]
    return {"trail": trimmed.stdout, "pan": pan, "argv": argv}


# ----------------------------------------------------------------------------- trails


@dataclasses.dataclass
class Step:
    number: int
    header: str
    details: List[str]
    req: Optional[int]

    @property
    def lines(self) -> List[str]:
        return [self.header, *self.details]

    def hooks(self) -> List[Tuple[str, Optional[str]]]:
        """``(hook, node)`` in the order printed; node is "prefill"/"decode" for the
        allocator hooks (the trail says whose pool), else None."""
        out = []
        for line in self.lines:
            if line.startswith("spin:"):
                continue
            for m in HOOK.finditer(line):
                name = m.group(1)
                node = None
                if name.startswith("PagedTokenToKVPoolAllocator"):
                    if "prefill page" in line:
                        node = "prefill"
                    elif re.search(r"decode (@|pages?\b)", line):
                        node = "decode"
                out.append((name, node))
        return out

    def text(self) -> str:
        return "\n".join([f"{self.number:3d}. {self.header}", *(f"       {d}" for d in self.details)])


def parse_trail(text: str) -> List[Step]:
    steps: List[Step] = []
    for line in text.splitlines():
        m = STEP.match(line)
        if m:
            header = m.group(2).strip()
            r = re.match(r"r(\d+):", header)
            steps.append(Step(int(m.group(1)), header, [], int(r.group(1)) if r else None))
        elif steps and line.strip():
            steps[-1].details.append(line.strip())
    return steps


def assertion_text(text: str) -> str:
    m = re.search(r"spin: text of failed assertion: (.*)", text)
    return m.group(1) if m else ""


# ----------------------------------------------------------------------------- real hooks


@functools.lru_cache(maxsize=1)
def _manifest_entries() -> Dict[str, List[Tuple[str, str]]]:
    """hook name (qualname, dots as underscores) -> (module, qualname) over every manifest,
    this release's first."""
    import importlib.metadata

    mine = PATCHES / f"sglang-{importlib.metadata.version('sglang')}.json"
    files = [mine] if mine.exists() else []
    files += [p for p in sorted(PATCHES.glob("sglang-*.json")) if p != mine]
    out: Dict[str, List[Tuple[str, str]]] = {}
    for path in files:
        for entry in json.loads(path.read_text())["targets"].values():
            if entry:
                key = entry["qualname"].replace(".", "_")
                pair = (entry["module"], entry["qualname"])
                if pair not in out.setdefault(key, []):
                    out[key].append(pair)
    return out


def resolve_hook(name: str) -> Optional[Tuple[object, str, object]]:
    """``(owner, attribute, callable)`` of the real function ``@name`` stands for in the
    installed SGLang, or None. The manifests give module and qualname; a method a release
    inherits (e.g. ``MooncakeKVReceiver.send_metadata`` defined on ``CommonKVReceiver``) is
    found on the named class."""
    for module_name, qualname in _manifest_entries().get(name, []):
        try:
            owner = sys.modules.get(module_name) or importlib.import_module(module_name)
            parts = qualname.split(".")
            for part in parts[:-1]:
                owner = getattr(owner, part)
            func = getattr(owner, parts[-1])
        except (ImportError, AttributeError):
            continue
        return owner, parts[-1], func
    return None


@dataclasses.dataclass
class Call:
    hook: str
    node: Optional[str]
    real: str  # the function that was called (module:qualname)
    thread: str


class Recorder:
    """Wraps SGLang's real functions named by hooks with a recorder of their calls.

    Installed OUTSIDE whatever is there already (kvguard's wrappers stay in the call path);
    ``uninstall`` puts back exactly what it replaced. Module-level functions are also
    replaced where other sglang modules imported them by name."""

    def __init__(self, node_of: Callable[[str, object], Optional[str]]):
        self.calls: List[Call] = []
        self._lock = threading.Lock()
        self._undo: List[Callable[[], None]] = []
        self._node_of = node_of
        self.active = False
        self.unresolved: List[str] = []
        self._tl = threading.local()

    def record(self, hook: str, node: Optional[str], real: str) -> None:
        if self.active:
            with self._lock:
                self.calls.append(Call(hook, node, real, threading.current_thread().name))

    def _wrap(self, hook: str, owner, attr: str, on_call=None, record: bool = True) -> None:
        raw = owner.__dict__.get(attr) if isinstance(owner, (type, types.ModuleType)) else None
        inherited = raw is None
        if inherited:
            raw = getattr(owner, attr)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        func = raw.__func__ if kind else raw
        real = f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', attr)}"
        rec = self

        @functools.wraps(func)
        def recorded(*args, **kwargs):
            if record:
                me = args[0] if args and not isinstance(owner, types.ModuleType) else None
                rec.record(hook, rec._node_of(hook, me), real)
            if on_call is not None:
                return on_call(func, *args, **kwargs)
            return func(*args, **kwargs)

        new = kind(recorded) if kind else recorded
        setattr(owner, attr, new)
        aliases = []
        if isinstance(owner, types.ModuleType):
            for mname, mod in list(sys.modules.items()):
                if mod is None or mod is owner or not mname.startswith("sglang"):
                    continue
                for k, v in list(getattr(mod, "__dict__", {}).items()):
                    if v is func:
                        setattr(mod, k, recorded)
                        aliases.append((mod, k))

        def undo():
            for mod, k in aliases:
                if getattr(mod, k, None) is recorded:
                    setattr(mod, k, func)
            if inherited:
                if owner.__dict__.get(attr) is new:
                    delattr(owner, attr)
            elif owner.__dict__.get(attr) is new:
                setattr(owner, attr, raw)

        self._undo.append(undo)

    def install(self, hooks: Iterable[str], aliases: Dict[str, Sequence[str]] = (), worker_step=None) -> None:
        """Wrap each hook's real function; ``aliases`` maps a hook to further attribute
        names on the same owner that count as that hook (e.g. the paged allocator's
        ``alloc_extend`` for ``..._alloc``)."""
        aliases = dict(aliases or {})
        for hook in sorted(set(hooks)):
            found = resolve_hook(hook)
            if found is None:
                self.unresolved.append(hook)
                continue
            owner, attr, _ = found
            if hook == worker_step:
                self._wrap_worker(hook, owner, attr)
                continue
            self._wrap(hook, owner, attr)
            for extra in aliases.get(hook, ()):
                if hasattr(owner, extra):
                    self._wrap(hook, owner, extra)
        self.active = True

    def _wrap_worker(self, hook: str, owner, attr: str) -> None:
        """The transfer worker is a loop a manager starts once, on its own thread. The
        model's ``@..._transfer_worker`` step is one turn of it: recorded each time the
        real loop, on its thread, hands a chunk to ``send_kvcache``."""
        tl = self._tl

        def on_call(func, *args, **kwargs):
            tl.worker = True
            return func(*args, **kwargs)

        self._wrap(hook, owner, attr, on_call=on_call, record=False)
        # the worker's per-chunk call (not a hook itself): record the turn there
        send = owner.__dict__.get("send_kvcache") or getattr(owner, "send_kvcache")
        rec = self
        real = f"{send.__module__}:{send.__qualname__}"

        @functools.wraps(send)
        def send_kvcache(*args, **kwargs):
            if getattr(tl, "worker", False):
                rec.record(hook, rec._node_of(hook, args[0]), real + " (in the transfer worker's loop)")
            return send(*args, **kwargs)

        had = "send_kvcache" in owner.__dict__
        setattr(owner, "send_kvcache", send_kvcache)

        def undo():
            if owner.__dict__.get("send_kvcache") is send_kvcache:
                if had:
                    setattr(owner, "send_kvcache", send)
                else:
                    delattr(owner, "send_kvcache")

        self._undo.append(undo)

    def uninstall(self) -> None:
        self.active = False
        while self._undo:
            self._undo.pop()()


# ----------------------------------------------------------------------------- matching


@dataclasses.dataclass
class Match:
    ok: bool
    step: Optional[int] = None  # the first step that could not be matched
    missing: Tuple = ()
    positions: Dict[int, List[int]] = dataclasses.field(default_factory=dict)


def match_steps(steps: Sequence[Tuple[int, List[Tuple[str, Optional[str]]]]], calls: Sequence[Call]) -> Match:
    """Are the trail's hooks a subsequence of the real calls, step by step?

    Steps keep their order: every call matched for step k comes after every call matched
    for step k-1. Inside one step (one atomic action of the model, which may span both
    nodes, e.g. the two doors) the printed order is not a claim of the model, so the
    hooks of a step may occur in any order, each matched by a distinct call. A node, where
    the trail gives one, must agree. Each hook takes the earliest call it can (hooks that
    name a node first), which keeps every step's last call as early as possible."""
    start = 0
    positions: Dict[int, List[int]] = {}
    for number, hooks in steps:
        used: List[int] = []
        missing = []
        for hook, node in sorted(hooks, key=lambda h: h[1] is None):
            idx = next((i for i in range(start, len(calls)) if i not in used and calls[i].hook == hook
                        and (node is None or calls[i].node == node)), None)
            if idx is None:
                missing.append((hook, node))
            else:
                used.append(idx)
        if missing:
            return Match(False, number, tuple(missing), positions)
        positions[number] = sorted(used)
        if used:
            start = max(used) + 1
    return Match(True, None, (), positions)
