"""Builders for REAL SGLang components on device="cpu" (component test tier).

Runs only inside a test-bed venv made by ``scripts/testbed.sh VERSION``; works against
whichever SGLang release is installed there. Everything returned here is SGLang's own
class (pools, allocator, radix cache, metadata buffers, PD queues, ``Req``); the only
test-side objects are

* ``SchedulerStandIn`` -- a light object carrying just the attributes the PD queues
  read from their ``scheduler`` (the real ``Scheduler`` needs a model worker);
* ``install_torch_alloc_kernels`` -- for releases whose paged allocator always launches
  Triton kernels (<= 0.5.21: ``alloc_extend_kernel[grid](...)`` /
  ``alloc_decode_kernel[grid](...)``, which fail on CPU with "0 active drivers"), a
  pure-torch replacement of exactly those two kernel launches. 0.5.22+ take SGLang's
  own torch fallback on CPU and are left alone.

Per-release differences are handled by feature detection (signatures, attributes)
plus ``SGLANG_VERSION`` checks; constructor calls go through ``call_supported`` so a
keyword a release does not accept is dropped, and a required one that we do not
supply fails with a clear message.

Transfer backend for queue tests: SGLang's own ``fake`` backend
(``sglang.srt.disaggregation.fake``) with requests addressed to
``FAKE_BOOTSTRAP_HOST`` -- the path SGLang's warm-up requests take. Both doors run
their real admission code, the decode side pre-allocates real pages from the real
paged allocator, and the fake receiver/sender complete the "transfer" at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import sys
import types
from array import array
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from packaging.version import Version

SGLANG_VERSION = Version(importlib.metadata.version("sglang"))
DEVICE = os.environ.get("KVGUARD_COMPONENT_DEVICE", "cpu")  # scripts/gpu-check.sh sets cuda


def at_least(version: str) -> bool:
    return SGLANG_VERSION >= Version(version)


# --------------------------------------------------------------------------------
# generic helpers
# --------------------------------------------------------------------------------
def call_supported(fn: Callable, /, **kwargs):
    """Call ``fn`` with the keyword arguments its signature accepts.

    Extra keywords (for other releases) are dropped; a required parameter without a
    value raises a TypeError naming the release, so signature drift is loud.
    """
    sig = inspect.signature(fn)
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    accepted = {k: v for k, v in kwargs.items() if k in params}
    missing = [
        name
        for name, p in params.items()
        if name != "self"
        and p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in accepted
    ]
    if missing:
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)} in sglang {SGLANG_VERSION} needs "
            f"{missing}; teach tests/component/_sglang_components.py about it"
        )
    return fn(**accepted)


def _first_attr(obj, *names, default=None):
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


# --------------------------------------------------------------------------------
# memory pools and allocator
# --------------------------------------------------------------------------------
def make_req_to_token_pool(size: int = 8, max_context_len: int = 1024, *, decode_pre_alloc: Optional[int] = None):
    """Real ``ReqToTokenPool`` (or ``DecodeReqToTokenPool`` when ``decode_pre_alloc``
    is given, as a decode server builds it)."""
    if decode_pre_alloc is not None:
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool as cls

        return call_supported(
            cls,
            size=size,
            max_context_len=max_context_len,
            device=DEVICE,
            enable_memory_saver=False,
            pre_alloc_size=decode_pre_alloc,
        )
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return call_supported(
        ReqToTokenPool,
        size=size,
        max_context_len=max_context_len,
        device=DEVICE,
        enable_memory_saver=False,
    )


@dataclasses.dataclass(frozen=True)
class TinyModelShape:
    """KV geometry of a tiny Llama-like model (matches nothing on disk)."""

    num_layers: int = 2
    num_kv_heads: int = 2
    num_attention_heads: int = 4
    head_dim: int = 16
    hidden_size: int = 64
    vocab_size: int = 256
    dtype: torch.dtype = torch.bfloat16


def make_kv_pool(size: int, page_size: int, shape: TinyModelShape = TinyModelShape()):
    """Real ``MHATokenToKVPool`` holding ``size`` token slots on CPU."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return call_supported(
        MHATokenToKVPool,
        size=size,
        page_size=page_size,
        dtype=shape.dtype,
        head_num=shape.num_kv_heads,
        head_dim=shape.head_dim,
        layer_num=shape.num_layers,
        device=DEVICE,
        enable_memory_saver=False,
        start_layer=0,
        end_layer=shape.num_layers - 1,
        enable_alt_stream=False,
    )


def mxfp8_pool_class():
    """``MHATokenToKVPoolMXFP8`` (MXFP8 block-scaled FP8 KV) where the release transfers it
    in PD (it registers its scale buffers: ``get_kv_scale_buf_infos``), else None (e.g.
    0.5.16 ships the pool but refuses PD with it: "scale buffers are not exposed")."""
    from sglang.srt.mem_cache import memory_pool

    cls = getattr(memory_pool, "MHATokenToKVPoolMXFP8", None)
    return cls if cls is not None and hasattr(cls, "get_kv_scale_buf_infos") else None


def make_mxfp8_pool(size: int, page_size: int, head_dim: int = 64):
    """Real ``MHATokenToKVPoolMXFP8``: FP8 K/V plus per-32-element UE8M0 scale buffers
    (``k_scale_buffer`` / ``v_scale_buffer``), sent as ``StateType.BLOCK_SCALE``."""
    shape = TinyModelShape(head_dim=head_dim)
    return call_supported(
        mxfp8_pool_class(), size=size, page_size=page_size, dtype=torch.float8_e4m3fn,
        head_num=shape.num_kv_heads, head_dim=head_dim, layer_num=shape.num_layers, device=DEVICE,
        enable_memory_saver=False, start_layer=0, end_layer=shape.num_layers - 1, enable_alt_stream=False,
    )


MLA_KV_LORA_RANK, MLA_ROPE_DIM, DSA_INDEX_HEAD_DIM = 32, 16, 128


def make_mla_pool(size: int, page_size: int, layers: int = 2, dtype=torch.bfloat16):
    """Real ``MLATokenToKVPool`` (DeepSeek-V2-style latent KV) on CPU."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return call_supported(
        MLATokenToKVPool, size=size, page_size=page_size, dtype=dtype, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM, layer_num=layers, device=DEVICE, enable_memory_saver=False,
        start_layer=0, end_layer=layers - 1,
    )


def dsa_pool_class():
    """The release's MLA + sparse-attention-indexer pool: ``DSATokenToKVPool``
    (``NSATokenToKVPool`` before the rename)."""
    from sglang.srt.mem_cache import memory_pool

    return getattr(memory_pool, "DSATokenToKVPool", None) or getattr(memory_pool, "NSATokenToKVPool")


def make_dsa_pool(size: int, page_size: int, layers: int = 2, dtype=torch.bfloat16):
    """Real DSA/NSA pool (latent KV plus the indexer's ``index_k_with_scale_buffer``) on CPU."""
    return call_supported(
        dsa_pool_class(), size=size, page_size=page_size, dtype=dtype, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM, layer_num=layers, device=DEVICE, index_head_dim=DSA_INDEX_HEAD_DIM,
        enable_memory_saver=False, kv_cache_dim=MLA_KV_LORA_RANK + MLA_ROPE_DIM, start_layer=0,
        end_layer=layers - 1,
    )


def make_paged_allocator(size: int, page_size: int, kv_pool, *, need_sort: bool = False):
    """Real ``PagedTokenToKVPoolAllocator`` over ``kv_pool`` (``size`` tokens)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return call_supported(
        PagedTokenToKVPoolAllocator,
        size=size,
        page_size=page_size,
        dtype=kv_pool.dtype if hasattr(kv_pool, "dtype") else torch.bfloat16,
        device=DEVICE,
        kvcache=kv_pool,
        need_sort=need_sort,
    )


def make_radix_cache(req_to_token_pool, allocator, page_size: int, *, disable: bool = False):
    """Real ``RadixCache`` over the given pools."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    sig = inspect.signature(RadixCache.__init__)
    if "params" in sig.parameters:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = call_supported(
            CacheInitParams,
            disable=disable,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
        )
        return RadixCache(params)
    return call_supported(
        RadixCache,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        disable=disable,
    )


def free_pages(allocator) -> int:
    """Free (incl. staged / released) pages according to the allocator itself."""
    return allocator.available_size() // allocator.page_size


# --------------------------------------------------------------------------------
# test-side shim for the Triton kernel launches of old paged allocators
# --------------------------------------------------------------------------------
def allocator_needs_torch_kernels(allocator=None) -> bool:
    """True when this release's paged allocator launches Triton kernels on CPU.

    0.5.22+ pick ``alloc_*_naive`` (torch) when the platform has no Triton
    (``allocator.use_triton_kernels`` is False); older releases have no such switch.
    """
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    if allocator is not None and hasattr(allocator, "use_triton_kernels"):
        return bool(allocator.use_triton_kernels)
    src = inspect.getsource(PagedTokenToKVPoolAllocator)
    return "use_triton_kernels" not in src


def _torch_alloc_extend(pre_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    """Pure-torch equivalent of SGLang's ``alloc_extend_kernel`` launch.

    For each request i (in batch order) write its extend_len = seq_len - pre_len
    slots into ``out_indices`` at the running offset: first the rest of its
    current partial page (``last_loc + 1 ...``), then whole new pages, then a final
    partial new page; new pages are taken from ``free_pages`` in order, each
    request starting after the pages the earlier requests need.
    """
    page_size = int(page_size)
    pre = pre_lens.tolist()
    seq = seq_lens.tolist()
    last = last_loc.tolist()
    out_pos = 0
    page_cursor = 0
    for p, s, l in zip(pre, seq, last):
        ext = s - p
        vals: List[int] = []
        # part 1: fill the partial page the prefix ends in
        n1 = min(s, -(-p // page_size) * page_size) - p
        vals.extend(range(l + 1, l + 1 + n1))
        remaining = ext - n1
        new_pages = -(-s // page_size) - (-(-p // page_size))
        for k in range(new_pages):
            page = int(free_pages[page_cursor + k])
            take = min(page_size, remaining)
            vals.extend(range(page * page_size, page * page_size + take))
            remaining -= take
        assert remaining == 0 and len(vals) == ext, (p, s, l, page_size)
        out_indices[out_pos : out_pos + ext] = torch.tensor(vals, dtype=out_indices.dtype)
        out_pos += ext
        page_cursor += new_pages


def _torch_alloc_decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    """Pure-torch equivalent of SGLang's ``alloc_decode_kernel`` launch: one new slot
    per request; a request whose new token starts a page takes the next free page."""
    page_size = int(page_size)
    page_cursor = 0
    for i, (s, l) in enumerate(zip(seq_lens.tolist(), last_loc.tolist())):
        if (s - 1) % page_size == 0:  # pages(seq) - pages(seq - 1) == 1
            out_indices[i] = int(free_pages[page_cursor]) * page_size
            page_cursor += 1
        else:
            out_indices[i] = l + 1


class _TorchKernelLaunch:
    """Stands where a ``@triton.jit`` kernel object was: ``kernel[grid](*args)``."""

    def __init__(self, name: str, impl: Callable, nargs: int):
        self.name, self.impl, self.nargs = name, impl, nargs
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs or len(args) != self.nargs:
                raise TypeError(
                    f"test shim for {self.name}: sglang {SGLANG_VERSION} launched it with "
                    f"{len(args)} args / {sorted(kwargs)}; the shim knows the "
                    f"{self.nargs}-argument form of 0.5.10-0.5.21"
                )
            self.calls += 1
            return self.impl(*args)

        return launch


@contextlib.contextmanager
def torch_alloc_kernels() -> Iterator[Optional[Dict[str, _TorchKernelLaunch]]]:
    """Replace the two Triton launches of the paged allocator with torch code, for
    releases that need it; yields the shim objects (or None when not needed)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    if not allocator_needs_torch_kernels():
        yield None
        return
    mod = sys.modules[PagedTokenToKVPoolAllocator.__module__]
    shims = {
        "alloc_extend_kernel": _TorchKernelLaunch("alloc_extend_kernel", _torch_alloc_extend, 7),
        "alloc_decode_kernel": _TorchKernelLaunch("alloc_decode_kernel", _torch_alloc_decode, 6),
    }
    saved = {}
    for name, shim in shims.items():
        if not hasattr(mod, name):
            raise RuntimeError(f"{mod.__name__}.{name} not found in sglang {SGLANG_VERSION}")
        saved[name] = getattr(mod, name)
        setattr(mod, name, shim)
    try:
        yield shims
    finally:
        for name, orig in saved.items():
            setattr(mod, name, orig)


# --------------------------------------------------------------------------------
# configuration context (server args, parallel ranks, a 1-rank gloo group)
# --------------------------------------------------------------------------------
_GLOO_GROUP = None


def gloo_group():
    """A real single-process gloo ProcessGroup (the PD queues all-reduce poll results
    over it). Created once per process on a loopback TCP store."""
    global _GLOO_GROUP
    import torch.distributed as dist

    if _GLOO_GROUP is None:
        if not dist.is_initialized():
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _GLOO_GROUP = dist.new_group(ranks=[0], backend="gloo")
    return _GLOO_GROUP


def _default_server_args_object():
    """A real ``ServerArgs`` for releases without a published runtime context
    (<= 0.5.17): the dataclass defaults, WITHOUT ``__post_init__`` (which would
    resolve a model path, probe GPUs, ...). The PD queues only pass it on to the
    KV manager; the fake backend ignores it."""
    from sglang.srt.server_args import ServerArgs

    sa = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            value = None
        object.__setattr__(sa, f.name, value)
    return sa


def has_runtime_context() -> bool:
    """0.5.18+ read configuration through ``sglang.srt.runtime_context`` bags."""
    try:
        mod = importlib.import_module("sglang.srt.runtime_context")
    except ImportError:
        return False
    return hasattr(mod.RuntimeContext, "override_server_args")


@contextlib.contextmanager
def sglang_config(**fields) -> Iterator[Any]:
    """Publish a test configuration the way the release expects and yield the
    ``ServerArgs`` object the scheduler would hold.

    0.5.18+: SGLang's own test hook ``get_context().override_server_args(**fields)``
    plus ``get_parallel().override(...)`` for a single rank (tp/pp/dp = 1).
    Older: a default ``ServerArgs`` with ``fields`` set on it, installed with
    ``set_global_server_args_for_scheduler`` when the release has it.
    """
    fields.setdefault("device", DEVICE)
    if has_runtime_context():
        import sglang.srt.runtime_context as rc
        from sglang.srt.runtime_context import get_context, get_parallel

        group = gloo_group()
        fake_group = types.SimpleNamespace(cpu_group=group, device_group=group, world_size=1, rank_in_group=0, rank=0)
        wanted = dict(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1,
            attn_tp_rank=0, attn_tp_size=1, attn_tp_group=fake_group,
            attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1,
            attn_dcp_rank=0, attn_dcp_size=1, moe_ep_rank=0, moe_ep_size=1,
            tp_group=fake_group, pp_group=fake_group,
        )
        if hasattr(rc, "_parallel_fields"):
            known = set(rc._parallel_fields())
        else:
            known = set(getattr(rc, "_PARALLEL_FIELDS", ()))
        par = {k: v for k, v in wanted.items() if k in known}
        override = get_context().override_server_args(**fields)
        server_args = override.install()
        try:
            with get_parallel().override(**par):
                yield server_args
        finally:
            override.restore()
        return

    server_args = _default_server_args_object()
    for k, v in fields.items():
        object.__setattr__(server_args, k, v)
    import sglang.srt.server_args as sa_mod

    setter = getattr(sa_mod, "set_global_server_args_for_scheduler", None)
    prev = getattr(sa_mod, "_global_server_args", None)
    if setter is not None:
        setter(server_args)
    # Old releases read ranks from parallel_state's group-coordinator globals
    # (e.g. decode's get_attention_tp_size()). Without initialising torch
    # distributed model parallelism we put a one-rank coordinator stand-in there.
    from sglang.srt.distributed import parallel_state as pstate

    group = gloo_group()
    coord = types.SimpleNamespace(
        world_size=1, rank_in_group=0, rank=0, ranks=[0], local_rank=0,
        cpu_group=group, device_group=group, is_first_rank=True, is_last_rank=True,
    )
    saved_groups = {}
    for name in ("_TP", "_PP", "_ATTN_TP", "_ATTN_CP", "_MOE_TP", "_MOE_EP"):
        if hasattr(pstate, name) and getattr(pstate, name) is None:
            saved_groups[name] = None
            setattr(pstate, name, coord)
    try:
        yield server_args
    finally:
        for name, value in saved_groups.items():
            setattr(pstate, name, value)
        if setter is not None:
            sa_mod._global_server_args = prev


# --------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------
def fake_bootstrap_host() -> str:
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    return FAKE_BOOTSTRAP_HOST


def _input_ids_container(ids):
    """``array('q')`` where the release's ``Req`` declares it (0.5.1x+), else list."""
    from sglang.srt.managers.schedule_batch import Req

    ann = inspect.signature(Req.__init__).parameters["origin_input_ids"].annotation
    if "array" in str(ann):
        return array("q", ids)
    return list(ids)


_ROOM = [1000]


def make_req(
    input_len: int = 40,
    *,
    rid: Optional[str] = None,
    max_new_tokens: int = 8,
    input_ids: Optional[List[int]] = None,
    bootstrap_host: Optional[str] = None,
    bootstrap_room: Optional[int] = None,
    vocab_size: int = 256,
    disagg_mode=None,
):
    """A real ``Req`` for this release, as ``Scheduler.handle_generate_request``
    builds it (bootstrap fields set for PD; fake-backend host by default)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    if input_ids is None:
        input_ids = [(7 * i + 3) % (vocab_size - 1) + 1 for i in range(input_len)]
    sp = call_supported(SamplingParams, max_new_tokens=max_new_tokens, temperature=0.0)
    if hasattr(sp, "normalize"):
        sp.normalize(None)
    if bootstrap_room is None:
        _ROOM[0] += 1
        bootstrap_room = _ROOM[0]
    rid = rid or f"kvguard-test-{bootstrap_room}"
    req = call_supported(
        Req,
        rid=rid,
        origin_input_text="",
        origin_input_ids=_input_ids_container(input_ids),
        sampling_params=sp,
        eos_token_ids=set(),
        bootstrap_host=bootstrap_host if bootstrap_host is not None else fake_bootstrap_host(),
        bootstrap_port=8998,
        bootstrap_room=bootstrap_room,
        disagg_mode=disagg_mode,
        vocab_size=vocab_size,
    )
    return req


def req_pool_idx(req):
    """``req.req_pool_idx`` (<= 0.5.18) or ``req.kv.req_pool_idx`` (0.5.19+)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return req.req_pool_idx


# --------------------------------------------------------------------------------
# scheduler stand-in and PD queues
# --------------------------------------------------------------------------------
class StreamRecorder:
    def __init__(self):
        self.calls: List[tuple] = []

    def stream_output(self, reqs, return_logprob=None, *args, **kwargs):
        self.calls.append((list(reqs), return_logprob))


class SchedulerStandIn:
    """Only the attributes ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` /
    ``DecodeTransferQueue`` read from their scheduler. Reading anything else raises
    AttributeError naming the attribute (and it is listed in ``missing``)."""

    def __init__(self, **attrs):
        object.__setattr__(self, "missing", [])
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.__dict__["missing"].append(name)
        raise AttributeError(
            f"SchedulerStandIn has no {name!r} (sglang {SGLANG_VERSION}); add it in "
            f"tests/component/_sglang_components.py if the queues need it"
        )


def _model_config(shape: TinyModelShape, context_len: int):
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.hidden_size * 2,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_position_embeddings=context_len,
    )
    return types.SimpleNamespace(
        hf_config=hf,
        hf_text_config=hf,
        num_hidden_layers=shape.num_layers,
        num_attention_layers=shape.num_layers,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        context_len=context_len,
        dtype=shape.dtype,
        hf_eos_token_id=set(),
        is_hybrid_swa=False,
        get_total_num_kv_heads=lambda: shape.num_kv_heads,
        get_num_kv_heads=lambda tp_size=1: shape.num_kv_heads,
    )


@dataclasses.dataclass
class PDSide:
    """Everything one PD role owns, all real SGLang objects except ``scheduler``."""

    mode: str
    page_size: int
    req_to_token_pool: Any
    kv_pool: Any
    allocator: Any
    tree_cache: Any
    metadata_buffers: Any
    metadata_allocator: Any
    scheduler: SchedulerStandIn
    server_args: Any
    bootstrap_queue: Any = None  # prefill
    prealloc_queue: Any = None  # decode
    transfer_queue: Any = None  # decode
    kernel_shims: Optional[dict] = None

    def new_req(self, input_len: int = 40, **kwargs):
        """``make_req`` for this role (``disagg_mode`` set as the scheduler does)."""
        from sglang.srt.disaggregation.utils import DisaggregationMode

        kwargs.setdefault("disagg_mode", DisaggregationMode(self.mode))
        kwargs.setdefault("vocab_size", self.scheduler.model_config.vocab_size)
        return make_req(input_len, **kwargs)


def start_bootstrap_server(wait_s: float = 5.0):
    """SGLang's real ``CommonKVBootstrapServer`` on a free loopback port, once it answers
    ``/health`` (at most ``wait_s``): ``(server, port)``; the caller closes it."""
    import time
    import urllib.request

    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    from sglang_kvguard.demo.deployment import free_ports

    port = free_ports(1)[0]
    server = CommonKVBootstrapServer("127.0.0.1", port)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            break
        except OSError:
            time.sleep(0.05)
    return server, port


def make_metadata_buffers(size: int, *, hidden_size: int = 16):
    from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator

    buffers = call_supported(
        MetadataBuffers,
        size=size,
        hidden_size=hidden_size,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=0,
        custom_mem_pool=None,
    )
    return buffers, ReqToMetadataIdxAllocator(size)


def _make_scheduler(side_kwargs: dict, shape: TinyModelShape, context_len: int, server_args):
    max_total = side_kwargs["max_total_num_tokens"]
    model_runner = types.SimpleNamespace(
        effective_max_total_num_tokens=max_total,
        effective_logical_max_total_num_tokens=max_total,
        max_total_num_tokens=max_total,
        max_token_pool_size=max_total,
        kv_cache_dtype_str="auto",
        swa_max_total_num_tokens=None,
    )
    tp_worker = types.SimpleNamespace(model_runner=model_runner, is_hybrid_swa=False)
    streamer = StreamRecorder()
    retired: List[Any] = []
    bootstrap_failures: List[Any] = []
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    ps = types.SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, gpu_id=0, attn_tp_rank=0, attn_tp_size=1)
    return SchedulerStandIn(
        server_args=server_args,
        model_config=_model_config(shape, context_len),
        tp_worker=tp_worker,
        req_to_token_pool=side_kwargs["req_to_token_pool"],
        token_to_kv_pool_allocator=side_kwargs["allocator"],
        tree_cache=side_kwargs["tree_cache"],
        max_total_num_tokens=max_total,
        page_size=side_kwargs["page_size"],
        output_streamer=streamer,
        stream_output=streamer.stream_output,
        stream_recorder=streamer,
        retired_unadmitted=retired,
        retire_unadmitted_request=retired.append,
        running_batch=types.SimpleNamespace(reqs=[]),
        waiting_queue=[],
        rust_server=None,
        kv_shard_widening=1,
        random_seed=42,
        enable_hisparse=False,
        hisparse_coordinator=None,
        enable_lora=False,
        enable_priority_scheduling=False,
        schedule_low_priority_values_first=False,
        enable_decode_hicache=False,
        sliding_window_size=None,
        ps=ps,
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, gpu_id=0,
        attn_tp_rank=0, attn_tp_size=1,
        enable_metrics=False,
        kv_checksum_computer=None,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        draft_worker=None,
        attn_tp_cpu_group=gloo_group(),
        attn_cp_cpu_group=gloo_group(),
        enable_hicache_storage=False,
        enable_overlap=False,
        last_batch=None,
        metrics_collector=None,
        metrics_reporter=types.SimpleNamespace(
            enable_metrics=False, current_scheduler_metrics_enabled=False
        ),
        processed_tokens_counter=0,
        bootstrap_failures=bootstrap_failures,
        batch_result_processor=types.SimpleNamespace(
            _maybe_update_reasoning_tokens=lambda req, token_id: None
        ),
        handle_bootstrap_failure=bootstrap_failures.append,
    )


def make_pd_side(
    mode: str,
    *,
    server_args,
    page_size: int = 16,
    num_tokens: int = 1024,
    max_reqs: int = 8,
    context_len: int = 2048,
    shape: TinyModelShape = TinyModelShape(),
    num_reserved_decode_tokens: int = 0,
    decode_radix_cache: bool = False,
    kv_pool: Any = None,
    draft_pool: Any = None,
) -> PDSide:
    """Build one PD role with real SGLang pools and queues on CPU.

    ``mode`` is "prefill" (-> ``bootstrap_queue``) or "decode" (-> ``prealloc_queue``
    and ``transfer_queue``). Must run inside ``sglang_config(...)``.
    """
    from sglang.srt.disaggregation.utils import TransferBackend

    assert mode in ("prefill", "decode")
    if mode == "decode":
        r2t = make_req_to_token_pool(max_reqs, context_len, decode_pre_alloc=max_reqs)
    else:
        r2t = make_req_to_token_pool(max_reqs, context_len)
    if kv_pool is None:
        kv_pool = make_kv_pool(num_tokens, page_size, shape)
    elif callable(kv_pool):  # a builder of another real pool class (MLA, DSA, ...)
        kv_pool = kv_pool(num_tokens, page_size)
    if callable(draft_pool):
        draft_pool = draft_pool(num_tokens, page_size)
    allocator = make_paged_allocator(num_tokens, page_size, kv_pool)
    # A decode server runs with the radix cache disabled unless
    # --disaggregation-decode-enable-radix-cache; mirror that by default.
    radix_disabled = mode == "decode" and not decode_radix_cache
    tree_cache = make_radix_cache(r2t, allocator, page_size, disable=radix_disabled)
    buffers, md_alloc = make_metadata_buffers(max_reqs * 2)
    side_kwargs = dict(
        req_to_token_pool=r2t, allocator=allocator, tree_cache=tree_cache,
        page_size=page_size, max_total_num_tokens=num_tokens,
    )
    scheduler = _make_scheduler(side_kwargs, shape, context_len, server_args)
    side = PDSide(
        mode=mode, page_size=page_size, req_to_token_pool=r2t, kv_pool=kv_pool,
        allocator=allocator, tree_cache=tree_cache, metadata_buffers=buffers,
        metadata_allocator=md_alloc, scheduler=scheduler, server_args=server_args,
    )
    common = dict(
        req_to_metadata_buffer_idx_allocator=md_alloc,
        metadata_buffers=buffers,
        tp_rank=0, tp_size=1, dp_size=1, gpu_id=0, pp_rank=0, pp_size=1,
        bootstrap_port=8998,
        gloo_group=gloo_group(),
        max_total_num_tokens=num_tokens,
        scheduler=scheduler,
        transfer_backend=TransferBackend.FAKE,
        draft_token_to_kv_pool=draft_pool,
    )
    if mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        metrics = None
        if "scheduler_stage_metrics" in inspect.signature(PrefillBootstrapQueue.__init__).parameters:
            metrics = _stage_metrics()
        side.bootstrap_queue = call_supported(
            PrefillBootstrapQueue,
            token_to_kv_pool=kv_pool,
            scheduler_stage_metrics=metrics,
            **common,
        )
        scheduler.disagg_prefill_bootstrap_queue = side.bootstrap_queue
    else:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

        side.transfer_queue = call_supported(DecodeTransferQueue, tree_cache=tree_cache, **common)
        side.prealloc_queue = call_supported(
            DecodePreallocQueue,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=allocator,
            transfer_queue=side.transfer_queue,
            tree_cache=tree_cache,
            num_reserved_decode_tokens=num_reserved_decode_tokens,
            **common,
        )
        scheduler.disagg_decode_transfer_queue = side.transfer_queue
        scheduler.disagg_decode_prealloc_queue = side.prealloc_queue
    return side


def _stage_metrics():
    """``scheduler_stage_metrics`` argument of 0.5.2x ``PrefillBootstrapQueue``."""
    from sglang.srt.disaggregation import prefill as prefill_mod

    cls = getattr(prefill_mod, "SchedulerStageMetricsRecorder", None)
    if cls is None:
        return None
    try:
        return call_supported(cls, enabled=False)
    except Exception:
        return None


# --------------------------------------------------------------------------------
# releasing
# --------------------------------------------------------------------------------
def transfer_chunk(room: int, page_ids, aux_index: int = 0):
    """A real ``TransferKVChunk`` sending ``page_ids`` (the whole chunk, last of its room,
    with prefill's metadata row ``aux_index``)."""
    try:
        from sglang.srt.disaggregation.common.utils import TransferKVChunk
    except ImportError:  # 0.5.10-0.5.12
        from sglang.srt.disaggregation.mooncake.conn import TransferKVChunk
    import numpy as np

    fields = {f.name for f in dataclasses.fields(TransferKVChunk)}
    kw = dict(
        room=room,
        prefill_kv_indices=np.asarray(page_ids, dtype=np.int32),
        index_slice=slice(0, len(page_ids)),
        is_last_chunk=True,
        prefill_aux_index=aux_index,
        state_indices=None,
    )
    return TransferKVChunk(**{k: v for k, v in kw.items() if k in fields})


def release_req_kv(req, tree_cache):
    """Give a request's KV back the way decode's abort path does: SGLang's own
    ``release_kv_cache`` without inserting into the radix tree
    (``is_insert=False`` <= 0.5.21, ``checkpoint=False`` 0.5.22+)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    params = inspect.signature(release_kv_cache).parameters
    if "checkpoint" in params:
        return release_kv_cache(req, tree_cache, checkpoint=False)
    return release_kv_cache(req, tree_cache, is_insert=False)


def release_metadata_slot(side: "PDSide", req) -> None:
    """Free the request's metadata buffer slot, as the prefill inflight queue does
    once a transfer finished (idempotent)."""
    idx = getattr(req, "metadata_buffer_index", -1)
    if idx is not None and idx >= 0:
        side.metadata_allocator.free(idx)
        req.metadata_buffer_index = -1


def snapshot(side: "PDSide") -> dict:
    """Resource counters of one PD side (all read from SGLang's own objects)."""
    return {
        "free_pages": free_pages(side.allocator),
        "req_slots": side.req_to_token_pool.available_size(),
        "metadata_slots": side.metadata_allocator.available_size(),
        "evictable": side.tree_cache.evictable_size(),
        "protected": side.tree_cache.protected_size(),
    }


# --------------------------------------------------------------------------------
# HiSparse (--enable-hisparse: DSA decode whose full KV lives in a host pool)
# --------------------------------------------------------------------------------
def hisparse_classes():
    """``(device pool, allocator, coordinator)`` classes of this release's HiSparse
    (``HiSparseDSATokenToKVPool``, ``HiSparseNSATokenToKVPool`` before the DSA rename;
    the allocator lived in ``hisparse_memory_pool`` before ``mem_cache/allocator/``),
    or None when the release has no HiSparse."""
    import importlib.util

    def has(module):
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent that is a module, not a package (allocator.py, 0.5.10-0.5.12)
            return False

    if not (has("sglang.srt.mem_cache.hisparse_memory_pool") and has("sglang.srt.managers.hisparse_coordinator")):
        return None
    from sglang.srt.mem_cache import hisparse_memory_pool as hmp  # other import errors are loud
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
    pool = getattr(hmp, "HiSparseDSATokenToKVPool", None) or getattr(hmp, "HiSparseNSATokenToKVPool", None)
    if has("sglang.srt.mem_cache.allocator.hisparse"):
        from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator as alloc
    else:  # before mem_cache/allocator/hisparse.py
        alloc = getattr(hmp, "HiSparseTokenToKVPoolAllocator", None)
    if pool is None or alloc is None:
        return None
    return pool, alloc, HiSparseCoordinator


def make_hisparse_dsa_pool(size: int, page_size: int, layers: int = 2, host_to_device_ratio: int = 2,
                           dtype=torch.bfloat16):
    """Real HiSparse DSA device pool: ``size`` device token slots (the hot buffer) plus
    an indexer sized for the logical space (``size * host_to_device_ratio``)."""
    pool_cls = hisparse_classes()[0]
    return call_supported(
        pool_cls, size=size, page_size=page_size, dtype=dtype, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM, layer_num=layers, device=DEVICE, index_head_dim=DSA_INDEX_HEAD_DIM,
        enable_memory_saver=False, kv_cache_dim=MLA_KV_LORA_RANK + MLA_ROPE_DIM, start_layer=0,
        end_layer=layers - 1, host_to_device_ratio=host_to_device_ratio,
    )


def make_hisparse_allocator(size: int, page_size: int, kv_pool, host_to_device_ratio: int = 2):
    """Real ``HiSparseTokenToKVPoolAllocator`` (logical space ``size * ratio``, device ``size``)."""
    alloc_cls = hisparse_classes()[1]
    return call_supported(
        alloc_cls, size=size, page_size=page_size, dtype=kv_pool.dtype, device=DEVICE, kvcache=kv_pool,
        need_sort=False, host_to_device_ratio=host_to_device_ratio,
    )


class _CudartStandIn:
    """Answers ``torch.cuda.cudart()``'s host-registration calls on a CPU-only torch."""

    def __init__(self):
        self.registered: List[tuple] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((int(ptr), int(size)))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0

    def cudaGetErrorString(self, rc):  # noqa: N802
        return "cudaSuccess"


@contextlib.contextmanager
def cpu_host_register() -> Iterator[_CudartStandIn]:
    """The one CUDA call on the way to a HiSparse host pool: its buffer is allocated
    in ordinary host memory (``HostTensorAllocator.allocate``), then page-locked for
    DMA with ``torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)``
    (``alloc_with_host_register``; ``pool_host/common.py`` 0.5.14+, ``memory_pool_host.py``
    before), which a CPU-only torch refuses ("Torch not compiled with CUDA enabled").
    Inside this block ``torch.cuda.cudart()`` returns a stand-in that records each
    (pointer, bytes) range and reports success; nothing else is replaced, and the
    buffer and its pointer are the ones upstream allocated."""
    stand_in = _CudartStandIn()
    saved = torch.cuda.cudart
    torch.cuda.cudart = lambda: stand_in
    try:
        yield stand_in
    finally:
        torch.cuda.cudart = saved


def make_hisparse_coordinator(req_to_token_pool, allocator, *, top_k: int = 64, device_buffer_size: int = 128,
                              host_to_device_ratio: int = 2):
    """SGLang's real ``HiSparseCoordinator`` (which builds the host pool the decode node
    registers for transfers, ``mem_pool_host``), as ``ModelRunner.maybe_init_hisparse_coordinator``
    calls it; returns ``(coordinator, cudart stand-in)`` (see ``cpu_host_register``)."""
    coord_cls = hisparse_classes()[2]
    with cpu_host_register() as cudart:
        coordinator = call_supported(
            coord_cls, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, top_k=top_k,
            device_buffer_size=device_buffer_size, device=DEVICE, tp_group=gloo_group(),
            host_to_device_ratio=host_to_device_ratio,
        )
    return coordinator, cudart


def make_hisparse_side(
    mode: str,
    *,
    server_args,
    page_size: int = 64,
    num_tokens: int = 256,
    max_reqs: int = 8,
    context_len: int = 2048,
    host_to_device_ratio: int = 2,
    shape: TinyModelShape = TinyModelShape(),
) -> PDSide:
    """One PD role built as ``--enable-hisparse`` builds it (``KVCacheConfigurator``: HiSparse
    DSA device pool of ``num_tokens`` slots + ``HiSparseTokenToKVPoolAllocator`` over a
    logical space ``host_to_device_ratio`` times larger; ``ModelRunner``: the
    ``HiSparseCoordinator`` with its host pool; the scheduler's ``enable_hisparse`` and
    ``hisparse_coordinator``), with the role's real PD queue, whose ``_init_kv_manager``
    registers what this release registers. Must run inside ``sglang_config(...)``.
    The coordinator is on ``side.hisparse_coordinator``, the cudart stand-in's record of
    host-registered ranges on ``side.host_registrations``."""
    from sglang.srt.disaggregation.utils import TransferBackend

    assert mode in ("prefill", "decode")
    r2t = make_req_to_token_pool(max_reqs, context_len, decode_pre_alloc=max_reqs if mode == "decode" else None)
    kv_pool = make_hisparse_dsa_pool(num_tokens, page_size, layers=shape.num_layers,
                                     host_to_device_ratio=host_to_device_ratio)
    allocator = make_hisparse_allocator(num_tokens, page_size, kv_pool, host_to_device_ratio)
    coordinator, cudart = make_hisparse_coordinator(r2t, allocator, host_to_device_ratio=host_to_device_ratio)
    # --enable-hisparse requires --disable-radix-cache (validate_hisparse)
    tree_cache = make_radix_cache(r2t, allocator, page_size, disable=True)
    buffers, md_alloc = make_metadata_buffers(max_reqs * 2)
    # HiSparse admits up to the host-backed logical capacity (``size``; ``_size_full`` on 0.5.10-0.5.13)
    max_total = int(getattr(allocator, "size", None) or allocator._size_full)
    side_kwargs = dict(req_to_token_pool=r2t, allocator=allocator, tree_cache=tree_cache, page_size=page_size,
                       max_total_num_tokens=max_total)
    scheduler = _make_scheduler(side_kwargs, shape, context_len, server_args)
    scheduler.enable_hisparse = True
    scheduler.hisparse_coordinator = coordinator
    scheduler.tp_worker.model_runner.hisparse_coordinator = coordinator
    side = PDSide(
        mode=mode, page_size=page_size, req_to_token_pool=r2t, kv_pool=kv_pool, allocator=allocator,
        tree_cache=tree_cache, metadata_buffers=buffers, metadata_allocator=md_alloc, scheduler=scheduler,
        server_args=server_args,
    )
    side.hisparse_coordinator = coordinator
    side.host_registrations = cudart.registered
    common = dict(
        req_to_metadata_buffer_idx_allocator=md_alloc, metadata_buffers=buffers, tp_rank=0, tp_size=1, dp_size=1,
        gpu_id=0, pp_rank=0, pp_size=1, bootstrap_port=8998, gloo_group=gloo_group(), max_total_num_tokens=max_total,
        scheduler=scheduler, transfer_backend=TransferBackend.FAKE, draft_token_to_kv_pool=None,
    )
    if mode == "prefill":
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        metrics = None
        if "scheduler_stage_metrics" in inspect.signature(PrefillBootstrapQueue.__init__).parameters:
            metrics = _stage_metrics()
        side.bootstrap_queue = call_supported(PrefillBootstrapQueue, token_to_kv_pool=kv_pool,
                                              scheduler_stage_metrics=metrics, **common)
        scheduler.disagg_prefill_bootstrap_queue = side.bootstrap_queue
        return side
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

    side.transfer_queue = call_supported(DecodeTransferQueue, tree_cache=tree_cache, **common)
    side.prealloc_queue = call_supported(
        DecodePreallocQueue, req_to_token_pool=r2t, token_to_kv_pool_allocator=allocator,
        transfer_queue=side.transfer_queue, tree_cache=tree_cache, num_reserved_decode_tokens=0, **common,
    )
    scheduler.disagg_decode_transfer_queue = side.transfer_queue
    scheduler.disagg_decode_prealloc_queue = side.prealloc_queue
    return side


# --------------------------------------------------------------------------------
# pool audit (tests/component/test_pool_audit.py): more of SGLang's real pools
# --------------------------------------------------------------------------------
def make_mla_fp4_pool(size: int, page_size: int, layers: int = 2):
    """Real ``MLATokenToKVPoolFP4`` (``--kv-cache-dtype fp4_e2m1`` on an MLA model):
    packed FP4 latent KV (``kv_buffer``) plus per-block scales (``kv_scale_buffer``)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    return call_supported(
        MLATokenToKVPoolFP4, size=size, page_size=page_size, dtype=torch.float4_e2m1fn_x2,
        kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_DIM, layer_num=layers, device=DEVICE,
        enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
    )


def make_mha_fp4_pool(size: int, page_size: int, head_dim: int = 64):
    """The release's FP4 MHA pool as its configurator builds it: with KV quantization
    recipes (0.5.16+ in the test beds) a ``MHATokenToKVPool`` with the ``fp4_mx_block16`` recipe's
    ``quant_method`` (packed K/V + ``k_scale_buffer`` / ``v_scale_buffer`` + dequant
    workspace); before, ``MHATokenToKVPoolFP4``."""
    from sglang.srt.mem_cache import memory_pool as mp

    shape = TinyModelShape(head_dim=head_dim)
    common = dict(size=size, page_size=page_size, dtype=torch.float4_e2m1fn_x2, head_num=shape.num_kv_heads,
                  head_dim=head_dim, layer_num=shape.num_layers, device=DEVICE, enable_memory_saver=False,
                  start_layer=0, end_layer=shape.num_layers - 1, enable_alt_stream=False)
    if "quant_method" in inspect.signature(mp.MHATokenToKVPool.__init__).parameters:
        from sglang.srt.layers.quantization import fp4_kv_cache_quant_method as fq

        qm = call_supported(fq.KV_CACHE_QUANT_REGISTRY["fp4_mx_block16"], num_layers=shape.num_layers,
                            device=DEVICE, page_size=page_size)
        return call_supported(mp.MHATokenToKVPool, quant_method=qm, **common)
    return call_supported(mp.MHATokenToKVPoolFP4, **common)


def has_vectorized_5d_layout() -> bool:
    """0.5.13+: ``MHATokenToKVPool`` can lay K/V out as ROCm AITER's SHUFFLE 5D
    (``SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d``)."""
    from sglang.srt.mem_cache import memory_pool as mp

    return "vectorized_5d" in inspect.getsource(mp.MHATokenToKVPool)


@contextlib.contextmanager
def rocm_aiter_platform(layout: str = "vectorized_5d"):
    """The platform an MHA pool reads its layout from, as on ROCm with AITER: SGLang's
    module flag ``memory_pool._use_aiter`` (``SGLANG_USE_AITER and is_hip()``, False on
    this CPU test bed) set True, and ``SGLANG_AITER_KV_CACHE_LAYOUT``. Nothing else is
    replaced: the pool, its buffers and what the PD queue registers are upstream's."""
    from sglang.srt.mem_cache import memory_pool as mp

    saved_flag, saved_env = mp._use_aiter, os.environ.get("SGLANG_AITER_KV_CACHE_LAYOUT")
    mp._use_aiter = True
    os.environ["SGLANG_AITER_KV_CACHE_LAYOUT"] = layout
    try:
        yield
    finally:
        mp._use_aiter = saved_flag
        if saved_env is None:
            os.environ.pop("SGLANG_AITER_KV_CACHE_LAYOUT", None)
        else:
            os.environ["SGLANG_AITER_KV_CACHE_LAYOUT"] = saved_env


def make_vectorized_5d_pool(size: int, page_size: int):
    """Real ``MHATokenToKVPool`` in the ``vectorized_5d`` layout: K as
    ``(num_blocks, heads, head_dim // x, page_size, x)``, one leading row per PAGE."""
    with rocm_aiter_platform("vectorized_5d"):
        pool = make_kv_pool(size, page_size)
    assert pool.kv_cache_layout == "vectorized_5d", pool.kv_cache_layout
    return pool


def minimax_sparse_pool_class():
    from sglang.srt.mem_cache import memory_pool as mp

    return getattr(mp, "MiniMaxSparseKVPool", None)


def make_minimax_sparse_pool(size: int, page_size: int):
    """Real ``MiniMaxSparseKVPool``: layer 0 dense, layer 1 sparse with a K-only index
    pool (``disable_value_sparse_layer_ids``, the PD-supported variant)."""
    return call_supported(
        minimax_sparse_pool_class(), size=size, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=16,
        idx_head_dim=16, dense_layer_ids=[0], sparse_layer_ids=[1], disable_value_sparse_layer_ids=[1],
        device=DEVICE, enable_memory_saver=False, start_layer=0, end_layer=2,
    )


def has_dsa_compress_tail() -> bool:
    return "index_kpool_compress" in inspect.signature(dsa_pool_class().__init__).parameters


def make_dsa_compress_pool(size: int, page_size: int, layers: int = 2):
    """Real DSA pool with a pooled, compressed indexer (``index_kpool=2``,
    ``index_kpool_compress``): registers ``StateType.DSA_TAIL`` beside the indexer.
    ``page_size`` is the logical page (64 x index_kpool)."""
    return call_supported(
        dsa_pool_class(), size=size, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM, layer_num=layers, device=DEVICE, index_head_dim=DSA_INDEX_HEAD_DIM,
        enable_memory_saver=False, kv_cache_dim=MLA_KV_LORA_RANK + MLA_ROPE_DIM, start_layer=0,
        end_layer=layers - 1, index_kpool=page_size // 64, index_kpool_compress=True, max_running_requests=8,
    )


def page_interleave_allocator_class():
    try:
        from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    except ImportError:
        return None
    return PageInterleavePoolAllocator


def make_page_interleave_allocator(size: int, page_size: int, kv_pool, shard_size: int = 2):
    """Real ``PageInterleavePoolAllocator`` (``--enable-kv-cache-sharding``, PD prefill
    only): ``shard_size`` x widened logical page space over one rank's pool."""
    return call_supported(
        page_interleave_allocator_class(), size=size, physical_page_size=page_size, shard_size=shard_size,
        dtype=torch.bfloat16, device=DEVICE, kvcache=kv_pool, need_sort=False,
    )


def double_sparse_pool_class():
    from sglang.srt.mem_cache import memory_pool as mp

    return getattr(mp, "DoubleSparseTokenToKVPool", None)


def make_double_sparse_pool(size: int, page_size: int):
    """Real ``DoubleSparseTokenToKVPool`` (``--enable-double-sparsity``)."""
    shape = TinyModelShape()
    return call_supported(
        double_sparse_pool_class(), size=size, page_size=page_size, dtype=shape.dtype, head_num=shape.num_kv_heads,
        head_dim=shape.head_dim, layer_num=shape.num_layers, device=DEVICE, heavy_channel_num=4,
        enable_memory_saver=False, start_layer=0, end_layer=shape.num_layers - 1,
    )
