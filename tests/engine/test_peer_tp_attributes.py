"""The SGLang state ``sglang_kvguard.guards._peer_tp.head_sliced`` reads exists on this release.

``head_sliced`` returns None (not head-sliced) when an attribute is missing, which is
right for the fake backend's receiver but would silently switch the head-sliced refusal
off if a release renamed them. So, on the running release, with SGLang's real classes:

* ``PrefillServerInfo`` (what decode builds from the prefill bootstrap server's
  ``/route`` reply) has an ``attn_tp_size`` field;
* ``CommonKVReceiver.init`` assigns ``self.prefill_info`` from ``kv_mgr.prefill_info_table``,
  and the Mooncake receiver runs it (does not override ``init``, or calls ``super().init``);
* ``CommonKVManager.__init__`` sets ``self.attn_tp_size`` and ``self.is_mla_backend`` (and,
  from 0.5.16, ``self.is_hybrid_mla_backend``), and the Mooncake manager does not
  replace ``__init__`` without calling it;
* the fake transfer backend's receiver sets no ``prefill_info`` (so it stays "not
  head-sliced").

These fail, never skip, when the attributes move.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

from packaging.version import Version

from _engine_support import RELEASE


def _src(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def test_prefill_server_info_carries_the_prefill_attention_tp():
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    fields = {f.name for f in dataclasses.fields(PrefillServerInfo)}
    assert "attn_tp_size" in fields, sorted(fields)


def test_receiver_init_copies_prefill_info_from_the_managers_table():
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    src = _src(CommonKVReceiver.init)
    assert re.search(r"self\.prefill_info\s*=\s*self\.kv_mgr\.prefill_info_table\[self\.bootstrap_addr\]", src), src
    assert "self.kv_mgr = " in _src(CommonKVReceiver.__init__)
    assert issubclass(MooncakeKVReceiver, CommonKVReceiver)
    if "init" in MooncakeKVReceiver.__dict__:
        assert "super().init(" in _src(MooncakeKVReceiver.init), "Mooncake's receiver no longer runs CommonKVReceiver.init"
    # kvguard's checks read prefill_info in send_metadata and at commit: init must run before send_metadata
    from sglang.srt.disaggregation import decode

    dsrc = inspect.getsource(decode)
    assert "kv_receiver.init(" in dsrc and "kv_receiver.send_metadata(" in dsrc


def test_kv_manager_sets_its_attention_tp_and_model_kind():
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    src = _src(CommonKVManager.__init__)
    assert re.search(r"self\.attn_tp_size\s*=", src), "CommonKVManager.__init__ no longer sets attn_tp_size"
    assert re.search(r"self\.is_mla_backend\s*=\s*is_mla_backend", src), "... no longer sets is_mla_backend"
    if Version(RELEASE) >= Version("0.5.16"):
        assert re.search(r"self\.is_hybrid_mla_backend\s*=", src), "... no longer sets is_hybrid_mla_backend"
    assert issubclass(MooncakeKVManager, CommonKVManager)
    if "__init__" in MooncakeKVManager.__dict__:
        assert "super().__init__(" in _src(MooncakeKVManager.__init__)
    # the receiver's manager attribute is this manager
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    assert "mgr" in inspect.signature(CommonKVReceiver.__init__).parameters


def test_fake_receiver_has_no_prefill_info():
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

    src = inspect.getsource(FakeKVReceiver)
    assert "prefill_info" not in src


def test_head_sliced_reads_real_prefill_server_info():
    """A real ``PrefillServerInfo`` from a bootstrap-style reply, on a receiver shaped as
    ``CommonKVReceiver.init`` leaves it (the component tier runs the whole real path)."""
    import types

    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    from sglang_kvguard.guards._peer_tp import head_sliced

    reply = {}
    for f in dataclasses.fields(PrefillServerInfo):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            reply[f.name] = {"attn_tp_size": 2, "dp_size": 1, "pp_size": 1, "attn_cp_size": 1,
                             "page_size": 16, "kv_cache_dtype": "auto"}.get(f.name, 1)
    info = PrefillServerInfo(**reply)
    assert info.attn_tp_size == 2
    mgr = types.SimpleNamespace(attn_tp_size=1, is_mla_backend=False)
    assert "prefill attention TP 2, decode attention TP 1" in head_sliced(
        types.SimpleNamespace(prefill_info=info, kv_mgr=mgr))
    mgr.is_mla_backend = True
    assert head_sliced(types.SimpleNamespace(prefill_info=info, kv_mgr=mgr)) is None
