"""Bring up a real, local, CPU-only prefill/decode (PD) SGLang deployment on loopback.

Three processes, each in its own process group, each logging to its own file:

* prefill server  ``python -m <launcher> --disaggregation-mode prefill ...``
* decode server   ``python -m <launcher> --disaggregation-mode decode ...``
* PD router       ``python -m sglang_router.launch_router --pd-disaggregation ...``

``launcher`` defaults to ``sglang.launch_server`` (the unguarded engine); pass
``"sglang_kvguard.launch_server"`` for the guarded one. Everything runs with
``--device cpu --load-format dummy --attention-backend torch_native`` and the KV
transfer goes through Mooncake over TCP, so no GPU and no weights are needed.

Usage::

    with PDDeployment(model_dir, log_dir=logs, prefill_max_total_tokens=256,
                      decode_max_total_tokens=2048) as d:
        r = d.generate("w1 w2 w3", max_new_tokens=4)
        assert r.status == 200, r.text

Teardown always runs (context manager, ``atexit``, and ``PR_SET_PDEATHSIG`` on the
three direct children; SGLang's own subprocesses already die with their parent):
each process group gets SIGTERM, then SIGKILL, and the groups are checked empty.

Release differences handled here (probed from the installed SGLang's source, not
from its version number):

* ``--disaggregation-transfer-backend mooncake_tcp`` exists from 0.5.15; older
  releases get ``mooncake`` plus ``MC_FORCE_TCP=1`` (what ``mooncake_tcp`` does).
* ``--disaggregation-decode-retraction-backup cpu_tensor`` is passed only where the
  flag exists (0.5.18+).
* Releases whose paged allocator always launches Triton kernels (<= 0.5.21) get
  ``TRITON_INTERPRET=1`` (Triton's CPU interpreter; no SGLang code changes).
* Where ``MooncakeKVSender.supports_host_tensor_indices`` exists (0.5.23), prefill
  pins host memory (CUDA only) unless a CPU shim turns it off; see
  ``tests/server/cpu_shim``. This module only reports the need
  (``ReleaseInfo.needs_host_tensor_shim``); the shim is put on ``extra_pythonpath``
  by the caller.

HTTP goes through kvguard's one client (``sglang_kvguard.tools.http``, on httpx); the
rest is the standard library.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..tools import http
from ..tools.http import Reply

__all__ = [
    "DeploymentError",
    "HTTPResult",
    "PDDeployment",
    "ReleaseInfo",
    "free_ports",
    "http_request",
    "probe_release",
]

DEFAULT_LAUNCHER = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"
# SGLANG_PLUGINS value that matches no plugin (an empty value would load them all).
NO_PLUGINS = "__kvguard_demo_no_plugins__"
# Lines SGLang logs when a server is dead even though its launcher still runs.
FATAL_LOG_PATTERNS = ("Scheduler hit an exception", "SIGQUIT received")


class DeploymentError(RuntimeError):
    """A deployment did not come up (or died); the message carries the log tails."""


# ----------------------------------------------------------------------------- HTTP


HTTPResult = Reply  # (status, latency_s / elapsed, text, body / json, error, timed_out, ok)


def http_request(
    url: str,
    payload: Optional[Mapping[str, Any]] = None,
    *,
    method: Optional[str] = None,
    timeout: float = 120.0,
) -> HTTPResult:
    """One HTTP request (JSON body if ``payload``) on kvguard's one HTTP client
    (``sglang_kvguard.tools.http``); never raises for HTTP errors: status 0 and ``error``
    when no answer came back."""
    return http.request(method or ("POST" if payload is not None else "GET"), url, payload, timeout=timeout)


# ----------------------------------------------------------------------------- ports

# Every port a deployment of one prefill and one decode uses, all picked by free_ports()
# at start (more nodes: see PDDeployment.port_names).
_PORT_NAMES = ("prefill", "decode", "router", "bootstrap", "router_metrics", "prefill_nccl", "decode_nccl")


def node_mode(name: str) -> str:
    """``prefill`` / ``decode`` of a node name (``prefill``, ``prefill2``, ``decode2``...)."""
    return "prefill" if name.startswith("prefill") else "decode" if name.startswith("decode") else name


def _ephemeral_range() -> Tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


# Ports the OS hands out for bind(0)/connect live in the ephemeral range, and so
# do the random ports ZMQ (49152+) picks inside SGLang. A port picked from there
# and released can be taken by one of those before the server that was meant to
# have it binds. Pick below the range instead; fall back to bind(0) if it is low.
_PICK_LO = 20000


def free_ports(n: int, host: str = "127.0.0.1", exclude: Sequence[int] = ()) -> List[int]:
    """``n`` distinct ports that were free a moment ago (all held open while picking).

    Chosen outside the kernel's ephemeral range where it leaves room, so that
    sockets the servers open meanwhile (ZMQ, Mooncake, HTTP clients) cannot be
    given the same port before its owner binds it.
    """
    lo_eph, _ = _ephemeral_range()
    hi = lo_eph - 1
    socks, ports = [], []
    taken = set(exclude)
    rng = random.Random()
    try:
        tries = 0
        while len(ports) < n:
            tries += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if hi - _PICK_LO >= 1000 and tries < 2000:
                cand = rng.randint(_PICK_LO, hi)
                if cand in taken:
                    s.close()
                    continue
                try:
                    s.bind((host, cand))
                except OSError:
                    s.close()
                    continue
            else:
                s.bind((host, 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in taken:
                taken.add(p)
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


# ----------------------------------------------------------------------------- release probe

_PROBE = r"""
import importlib.util, importlib.metadata as md, json, os, glob
out = {}
spec = importlib.util.find_spec("sglang")
root = os.path.dirname(spec.origin) if spec and spec.origin else None
out["root"] = root
try:
    out["version"] = md.version("sglang")
except Exception:
    out["version"] = None
def read(*rel):
    txt = ""
    for r in rel:
        for p in glob.glob(os.path.join(root, *r.split("/"))):
            try:
                txt += open(p, encoding="utf-8").read()
            except OSError:
                pass
    return txt
if root:
    args = read("srt/server_args.py", "srt/arg_groups/*.py", "srt/arg_groups/fields/*.py")
    out["mooncake_tcp"] = '"mooncake_tcp"' in args
    out["retraction_backup"] = "disaggregation_decode_retraction_backup" in args
    out["host_tensor_indices"] = "supports_host_tensor_indices" in read("srt/disaggregation/mooncake/conn.py")
    out["plugins_in_scheduler"] = "load_plugins()" in read("srt/managers/scheduler.py")
    paged = read("srt/mem_cache/allocator/paged.py", "srt/mem_cache/allocator.py")
    out["triton_only_allocator"] = bool(paged) and "use_triton_kernels" not in paged
out["router"] = importlib.util.find_spec("sglang_router") is not None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class ReleaseInfo:
    version: Optional[str]
    root: Optional[str]
    has_mooncake_tcp: bool
    has_retraction_backup: bool
    needs_host_tensor_shim: bool
    plugins_in_scheduler: bool
    has_router: bool
    triton_only_allocator: bool = False

    @property
    def version_tuple(self):
        import re

        nums = re.findall(r"\d+", self.version or "0")[:3]
        return tuple(int(x) for x in nums)


_probe_cache: Dict[str, ReleaseInfo] = {}


def has_sleep_on_idle() -> bool:
    """Whether this interpreter's SGLang has ``--sleep-on-idle`` (0.5.10-0.5.19; read from
    its ``server_args.py``, not imported): an idle scheduler then stops busy-polling."""
    from ..engine.runtime import module_file

    path = module_file("sglang.srt.server_args")
    return path is not None and "sleep_on_idle" in path.read_text()


def probe_release(python: str = sys.executable) -> ReleaseInfo:
    """Read (without importing SGLang) what the installed release supports."""
    if python in _probe_cache:
        return _probe_cache[python]
    env = dict(os.environ)
    env["KVGUARD_AUTO_INSTALL"] = "0"
    cp = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env)
    if cp.returncode != 0:
        raise DeploymentError(f"cannot probe SGLang with {python}: {cp.stderr[-2000:]}")
    d = json.loads(cp.stdout.strip().splitlines()[-1])
    if not d.get("root"):
        raise DeploymentError(f"SGLang is not installed for {python}")
    info = ReleaseInfo(
        version=d.get("version"),
        root=d.get("root"),
        has_mooncake_tcp=bool(d.get("mooncake_tcp")),
        has_retraction_backup=bool(d.get("retraction_backup")),
        needs_host_tensor_shim=bool(d.get("host_tensor_indices")),
        plugins_in_scheduler=bool(d.get("plugins_in_scheduler")),
        has_router=bool(d.get("router")),
        triton_only_allocator=bool(d.get("triton_only_allocator")),
    )
    _probe_cache[python] = info
    return info


# ----------------------------------------------------------------------------- processes


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _pids_in_group(pgid: int) -> List[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        # fields after the ")" of comm: state ppid pgrp ...
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 3 and rest[0] != "Z" and int(rest[2]) == pgid:
            pids.append(int(d))
    return pids


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class _Proc:
    role: str
    argv: List[str]
    env: Dict[str, str]
    log_path: Path
    popen: Optional[subprocess.Popen] = None
    started: float = 0.0
    spawned_after: Optional[float] = None
    healthy_after: Optional[float] = None
    peak_rss: int = 0

    @property
    def pgid(self) -> Optional[int]:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


_ANSI = __import__("re").compile(r"\x1b\[[0-9;]*m")  # the router logs in colour


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 200 * lines))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(_ANSI.sub("", line) for line in data.splitlines()[-lines:])


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)


_live: "weakref.WeakSet[PDDeployment]" = weakref.WeakSet()


@atexit.register
def _teardown_all() -> None:
    for d in list(_live):
        try:
            d.stop()
        except Exception:
            pass


@dataclass(eq=False)  # identity hash: instances live in a WeakSet
class PDDeployment:
    """A prefill server, a decode server and a PD router on 127.0.0.1 (or, with
    ``prefill_nodes`` / ``decode_nodes`` > 1, that many of each behind the one router:
    nodes ``prefill``, ``prefill2``, ... and ``decode``, ``decode2``, ..., each with
    its own ports and log; the per-role arguments apply to every node of the role).

    Pool sizes are per role (``--max-total-tokens``); ``context_length`` (if given)
    is passed to both servers as ``--context-length``. ``extra_args`` /
    ``*_env`` are appended per role; ``env`` goes to all three processes (applied
    last, so it can override anything set here).
    ``extra_pythonpath`` is prepended to ``PYTHONPATH`` of the two servers (e.g. a
    directory holding a test-side SGLang plugin). ``sglang_plugins``, when not
    None, is written to ``SGLANG_PLUGINS`` (SGLang's allow-list of entry-point
    plugins, honoured from 0.5.15; an empty list loads none). Leaving it None
    loads every installed plugin -- including kvguard's own entry point when
    kvguard is installed, i.e. the servers are then guarded.
    """

    model_path: Union[str, os.PathLike]
    log_dir: Union[str, os.PathLike]
    python: str = sys.executable
    launcher: str = DEFAULT_LAUNCHER
    prefill_max_total_tokens: int = 2048
    decode_max_total_tokens: int = 2048
    context_length: Optional[int] = None
    page_size: int = 16
    load_format: str = "dummy"  # "auto" for a model written with weights (make_tiny_model(weights_seed=...))
    transfer_backend: Optional[str] = None  # None: mooncake_tcp where it exists
    prefill_extra_args: Sequence[str] = ()
    decode_extra_args: Sequence[str] = ()
    router_extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    prefill_env: Mapping[str, str] = field(default_factory=dict)
    decode_env: Mapping[str, str] = field(default_factory=dict)
    router_env: Mapping[str, str] = field(default_factory=dict)
    extra_pythonpath: Sequence[Union[str, os.PathLike]] = ()
    sglang_plugins: Optional[Sequence[str]] = None
    startup_timeout: float = 420.0
    router_settle_timeout: float = 60.0
    host: str = "127.0.0.1"
    threads_per_server: Optional[int] = 1
    prefill_nodes: int = 1
    decode_nodes: int = 1

    def __post_init__(self) -> None:
        self.model_path = str(Path(self.model_path).resolve())
        self.log_dir = Path(self.log_dir)
        self.release: Optional[ReleaseInfo] = None
        self.procs: Dict[str, _Proc] = {}
        self.ports: Dict[str, int] = {}
        self.startup_seconds: Optional[float] = None
        self.peak_rss_total = 0
        self._sampler: Optional[threading.Thread] = None
        self._stop_sampling = threading.Event()
        self._stopped = False
        self._t0: Optional[float] = None

    # -- nodes and urls
    @property
    def prefill_names(self) -> List[str]:
        return ["prefill"] + [f"prefill{i}" for i in range(2, self.prefill_nodes + 1)]

    @property
    def decode_names(self) -> List[str]:
        return ["decode"] + [f"decode{i}" for i in range(2, self.decode_nodes + 1)]

    @property
    def node_names(self) -> List[str]:
        return self.prefill_names + self.decode_names

    def port_names(self) -> List[str]:
        names = list(_PORT_NAMES)
        for n in self.node_names:
            if n not in ("prefill", "decode"):
                names += [n, f"{n}_nccl"] + ([f"{n}_bootstrap"] if node_mode(n) == "prefill" else [])
        return names

    def bootstrap_port(self, name: str) -> int:
        return self.ports["bootstrap" if name in ("prefill", "decode") or node_mode(name) == "decode"
                          else f"{name}_bootstrap"]

    def url(self, name: str) -> str:
        """The HTTP URL of node ``name`` (or of ``router``)."""
        return f"http://{self.host}:{self.ports[name]}"

    @property
    def node_urls(self) -> Dict[str, str]:
        return {n: self.url(n) for n in self.node_names}

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.ports['prefill']}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.host}:{self.ports['decode']}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.ports['router']}"

    # -- command lines
    def _server_argv(self, name: str) -> List[str]:
        rel = self.release
        assert rel is not None
        role = node_mode(name)
        backend = self.transfer_backend or ("mooncake_tcp" if rel.has_mooncake_tcp else "mooncake")
        pool = self.prefill_max_total_tokens if role == "prefill" else self.decode_max_total_tokens
        argv = [
            self.python, "-m", *self.launcher.split(),
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.ports[name]),
            "--device", "cpu",
            "--load-format", self.load_format,
            "--attention-backend", "torch_native",
            "--page-size", str(self.page_size),
            "--max-total-tokens", str(pool),
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(self.bootstrap_port(name)),
            "--disable-overlap-schedule",
            "--log-level", "info",
        ]
        extra = list(self.prefill_extra_args if role == "prefill" else self.decode_extra_args)
        if "--nccl-port" not in extra:
            # Before 0.5.23 SGLang picks its torch.distributed rendezvous port with
            # bind(0), i.e. inside the ephemeral range, and binds it seconds later;
            # a socket of the other server can take it meanwhile (EADDRINUSE in
            # TCPStore, the scheduler dies at start-up). Pick it here, below the range.
            argv += ["--nccl-port", str(self.ports[f"{name}_nccl"])]
        if self.context_length is not None:
            argv += ["--context-length", str(self.context_length)]
        if role == "decode" and rel.has_retraction_backup:
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        argv += extra
        return argv

    def _router_argv(self) -> List[str]:
        nodes: List[str] = []
        for n in self.prefill_names:
            nodes += ["--prefill", self.url(n), str(self.bootstrap_port(n))]
        for n in self.decode_names:
            nodes += ["--decode", self.url(n)]
        return [
            self.python, "-m", ROUTER_MODULE,
            "--pd-disaggregation",
            *nodes,
            "--host", self.host,
            "--port", str(self.ports["router"]),
            "--prometheus-host", self.host,
            "--prometheus-port", str(self.ports["router_metrics"]),
            "--log-level", "info",
            # Workers are already healthy when the router starts; if its first
            # registration attempt still misses, retry after 1 s, not the default 30 s.
            "--worker-startup-check-interval", "1",
            *self.router_extra_args,
        ]

    def _env(self, name: str) -> Dict[str, str]:
        role = node_mode(name)
        env = dict(os.environ)
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "PYTHONNOUSERSITE": "1",
                "KVGUARD_ROLE": role,
            }
        )
        if role != "router":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            if self.threads_per_server:
                n = str(self.threads_per_server)
                env.setdefault("OMP_NUM_THREADS", n)
                env.setdefault("MKL_NUM_THREADS", n)
            assert self.release is not None
            if not self.release.has_mooncake_tcp and not self.transfer_backend:
                env["MC_FORCE_TCP"] = "1"
            if self.release.triton_only_allocator:
                # <= 0.5.21 launch Triton kernels for paged alloc_extend/alloc_decode
                # even on CPU ("0 active drivers"); Triton's own interpreter runs
                # them on CPU tensors. Nothing else Triton runs on these paths.
                env.setdefault("TRITON_INTERPRET", "1")
            if self.extra_pythonpath:
                pp = [str(Path(p).resolve()) for p in self.extra_pythonpath]
                if env.get("PYTHONPATH"):
                    pp.append(env["PYTHONPATH"])
                env["PYTHONPATH"] = os.pathsep.join(pp)
            if self.sglang_plugins is not None:
                # SGLang treats an EMPTY allow-list as "no filter, load all"; a
                # name no plugin has makes an empty list mean "load none".
                env["SGLANG_PLUGINS"] = ",".join(self.sglang_plugins) or NO_PLUGINS
        env.update(self.env)
        env.update({"prefill": self.prefill_env, "decode": self.decode_env, "router": self.router_env}[role])
        return env

    # -- lifecycle
    def __enter__(self) -> "PDDeployment":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "PDDeployment":
        t0 = self._t0 = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.release = probe_release(self.python)
        if not self.release.has_router:
            raise DeploymentError(f"sglang_router is not installed for {self.python}")
        names = self.port_names()
        p = free_ports(len(names), self.host)
        self.ports = dict(zip(names, p))
        _live.add(self)
        self._start_sampler()
        for name in self.node_names:
            self._spawn(name, self._server_argv(name))
        self._wait_healthy(self.node_names, t0)
        self._start_router(t0)
        self.startup_seconds = time.monotonic() - t0
        return self

    def _start_router(self, t0: float, attempts: int = 3) -> None:
        """Spawn the router; if it loses a port race, pick fresh ports and respawn.

        The router's two ports were picked before the servers started (30-100 s
        earlier); the servers' own sockets may have taken one since. The router
        then exits at once with "Address already in use". That is the harness's
        fault, not the deployment's, so try again on new ports.
        """
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                used = [v for k, v in self.ports.items() if k not in ("router", "router_metrics")]
                self.ports["router"], self.ports["router_metrics"] = free_ports(2, self.host, exclude=used)
            self._spawn("router", self._router_argv())
            try:
                self._wait_router(t0)
                return
            except DeploymentError:
                proc = self.procs["router"]
                if attempt == attempts or proc.alive() or "Address already in use" not in self.log_tail("router", 200):
                    raise
                with open(proc.log_path, "ab") as logf:
                    logf.write(b"# kvguard demo: router lost a port race; respawning on fresh ports\n")

    def _spawn(self, role: str, argv: List[str]) -> None:
        log_path = self.log_dir / f"{role}.log"
        env = self._env(role)
        proc = _Proc(role, argv, env, log_path)
        with open(log_path, "ab") as logf:
            logf.write(f"# kvguard demo: {shlex.join(argv)}\n".encode())
            logf.flush()
            proc.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.log_dir),
                start_new_session=True,  # own process group: killpg reaches SGLang's children
                preexec_fn=_set_pdeathsig,
            )
        proc.started = time.monotonic()
        if self._t0 is not None:
            proc.spawned_after = proc.started - self._t0
        self.procs[role] = proc

    def _check_alive(self) -> None:
        for role, p in self.procs.items():
            if not p.alive():
                rc = p.popen.returncode if p.popen else None
                raise DeploymentError(f"{role} exited with code {rc}\n" + self.describe())
            # SGLang keeps its launcher alive for ~65 s after a scheduler crash
            # (crash diagnostics); fail fast instead of waiting for that.
            if role != "router":
                text = self.log_tail(role, 400)
                for pat in FATAL_LOG_PATTERNS:
                    if pat in text:
                        raise DeploymentError(f"{role} failed ({pat!r} in its log)\n" + self.describe())

    def _wait_healthy(self, roles: Sequence[str], t0: float) -> None:
        pending = set(roles)
        while pending:
            self._check_alive()
            if time.monotonic() - t0 > self.startup_timeout:
                self._dump_stacks(sorted(pending))
                raise DeploymentError(
                    f"timed out after {self.startup_timeout:.0f}s waiting for {sorted(pending)} to become healthy\n"
                    + self.describe()
                )
            for role in sorted(pending):
                r = http_request(self.url(role) + "/health", timeout=5)
                if r.status == 200:
                    pending.discard(role)
                    self.procs[role].healthy_after = time.monotonic() - t0
            if pending:
                time.sleep(0.5)

    STACK_DUMP_ENV = "KVGUARD_TEST_STACK_DUMPS"

    def _dump_stacks(self, roles: Sequence[str]) -> None:
        """Ask every process of ``roles`` to write its Python stacks into its log.

        Only when the servers run with ``KVGUARD_TEST_STACK_DUMPS=1`` (the test tier's
        ``sitecustomize`` then registers ``faulthandler`` on SIGUSR2 in every process);
        without it SIGUSR2 would kill them, so nothing is sent."""
        if self.env.get(self.STACK_DUMP_ENV) != "1":
            return
        sent = False
        for role in roles:
            p = self.procs.get(role)
            for pid in _pids_in_group(p.pgid) if p is not None and p.pgid else []:
                try:
                    os.kill(pid, signal.SIGUSR2)
                    sent = True
                except (ProcessLookupError, PermissionError):
                    pass
        if sent:
            time.sleep(2.0)

    def _wait_router(self, t0: float) -> None:
        """Router /health, then a 1-token /generate until it stops answering 503.

        The router answers 503 until its health checker has registered both
        workers (about 2 s); a real request is the only reliable readiness test.
        """
        deadline = time.monotonic() + self.router_settle_timeout
        last: Optional[HTTPResult] = None
        while True:
            self._check_alive()
            if time.monotonic() > deadline or time.monotonic() - t0 > self.startup_timeout:
                raise DeploymentError(f"router never became ready; last probe: {last!r}\n" + self.describe())
            last = http_request(self.router_url + "/health", timeout=5)
            if last.status == 200:
                last = self.generate("w1", max_new_tokens=1, timeout=60)
                if last.status == 200:
                    self.procs["router"].healthy_after = time.monotonic() - t0
                    return
            time.sleep(0.5)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_sampling.set()
        order = [r for r in ["router", *self.decode_names, *self.prefill_names] if r in self.procs]
        order += [r for r in self.procs if r not in order]
        groups = {r: self.procs[r].pgid for r in order if self.procs[r].pgid}
        for r in order:
            self._signal_group(groups.get(r), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_pids_in_group(g) for g in groups.values()):
            time.sleep(0.2)
        for r in order:
            self._signal_group(groups.get(r), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_pids_in_group(g) for g in groups.values()):
            time.sleep(0.1)
        for p in self.procs.values():
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        _live.discard(self)
        left = {r: _pids_in_group(g) for r, g in groups.items()}
        left = {r: v for r, v in left.items() if v}
        if left:
            raise DeploymentError(f"processes survived teardown: {left}")

    # -- process control (chaos tests)
    def alive(self) -> Dict[str, bool]:
        """role -> whether its launcher process is still running."""
        return {role: p.alive() for role, p in self.procs.items()}

    def freeze(self, role: str, seconds: float) -> None:
        """SIGSTOP every process of ``role`` (a frozen machine), SIGCONT after ``seconds``."""
        pgid = self.procs[role].pgid
        self._signal_group(pgid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self._signal_group(pgid, signal.SIGCONT)

    def restart(self, role: str) -> float:
        """SIGKILL every process of ``role`` (a crashed node), start it again on the same
        ports and wait until it answers /health; returns the seconds it was down."""
        assert role in self.node_names, role
        proc = self.procs[role]
        t0 = time.monotonic()
        pgid = proc.pgid
        self._signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pgid and _pids_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.popen is not None:
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        with open(proc.log_path, "ab") as logf:
            logf.write(f"# kvguard demo: {role} killed (SIGKILL) and restarted\n".encode())
        for attempt in range(60):  # its ports may linger for a moment after the kill
            self._spawn(role, proc.argv)
            try:
                self._wait_healthy((role,), time.monotonic())
                break
            except DeploymentError:
                if "Address already in use" not in self.log_tail(role, 200) or attempt == 59:
                    raise
                time.sleep(1.0)
        return time.monotonic() - t0

    @staticmethod
    def _signal_group(pgid: Optional[int], sig: int) -> None:
        if not pgid:
            return
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def leftover_pids(self) -> Dict[str, List[int]]:
        return {r: _pids_in_group(p.pgid) for r, p in self.procs.items() if p.pgid}

    # -- memory sampling
    def _start_sampler(self, period: float = 0.5) -> None:
        def run() -> None:
            while not self._stop_sampling.wait(period):
                total = 0
                for p in list(self.procs.values()):
                    if p.pgid is None:
                        continue
                    rss = sum(_rss_bytes(pid) for pid in _pids_in_group(p.pgid))
                    p.peak_rss = max(p.peak_rss, rss)
                    total += rss
                self.peak_rss_total = max(self.peak_rss_total, total)

        self._sampler = threading.Thread(target=run, name="kvguard-rss-sampler", daemon=True)
        self._sampler.start()

    def stats(self) -> Dict[str, Any]:
        return {
            "sglang": self.release.version if self.release else None,
            "launcher": self.launcher,
            "startup_seconds": _r(self.startup_seconds),
            "spawned_after": {r: _r(p.spawned_after) for r, p in self.procs.items()},
            "healthy_after": {r: _r(p.healthy_after) for r, p in self.procs.items()},
            "peak_rss_mib": {r: round(p.peak_rss / 2**20) for r, p in self.procs.items()},
            "peak_rss_total_mib": round(self.peak_rss_total / 2**20),
        }

    # -- logs
    def log_tail(self, role: str, lines: int = 60) -> str:
        p = self.procs.get(role)
        return _tail(p.log_path if p else self.log_dir / f"{role}.log", lines)

    def log_text(self, role: str) -> str:
        p = self.procs.get(role)
        path = p.log_path if p else self.log_dir / f"{role}.log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self, lines: int = 40) -> str:
        out = [f"PD deployment ({self.release.version if self.release else '?'}), logs in {self.log_dir}"]
        for role, p in self.procs.items():
            state = "running" if p.alive() else f"exited rc={p.popen.returncode if p.popen else None}"
            out.append(f"--- {role} [{state}] {p.log_path} (last {lines} lines)")
            out.append(self.log_tail(role, lines))
        return "\n".join(out)

    # -- requests
    def generate(
        self,
        text: Optional[str] = None,
        *,
        input_ids: Optional[List[int]] = None,
        max_new_tokens: int = 8,
        temperature: float = 0.0,
        sampling_params: Optional[Mapping[str, Any]] = None,
        url: Optional[str] = None,
        timeout: float = 120.0,
        **extra: Any,
    ) -> HTTPResult:
        """POST /generate (to the router unless ``url`` is given)."""
        sp = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        sp.update(sampling_params or {})
        payload: Dict[str, Any] = {"sampling_params": sp, **extra}
        if input_ids is not None:
            payload["input_ids"] = list(input_ids)
        else:
            payload["text"] = text
        return http_request((url or self.router_url) + "/generate", payload, timeout=timeout)

    def completions(
        self,
        prompt: str,
        *,
        max_tokens: int = 8,
        temperature: float = 0.0,
        url: Optional[str] = None,
        timeout: float = 120.0,
        **extra: Any,
    ) -> HTTPResult:
        """POST /v1/completions (OpenAI-compatible; to the router unless ``url``)."""
        payload = {"model": self.model_path, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        payload.update(extra)
        return http_request((url or self.router_url) + "/v1/completions", payload, timeout=timeout)

    def server_info(self, role: str) -> HTTPResult:
        url = self.url(role)
        r = http_request(url + "/server_info", timeout=30)
        if r.status == 404:
            r = http_request(url + "/get_server_info", timeout=30)
        return r
