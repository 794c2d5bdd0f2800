"""TEST-ONLY CPU shim for real SGLang servers on a machine without a GPU.

What: sets ``MooncakeKVSender.supports_host_tensor_indices = False``.
Why:  from 0.5.23 the prefill side, when the sender advertises host tensor indices,
      copies page indices into ``torch.empty(..., pin_memory=True)`` and records a
      ``torch.cuda.Event``; both need CUDA, so on CPU prefill dies at the first KV
      send. With the attribute off, prefill takes SGLang's own other branch
      (``kv_to_page_indices``), exactly what releases up to 0.5.22 always do.
      It changes no KV-ownership logic. Releases without the attribute: no-op.
How:  this directory goes on PYTHONPATH of the test servers. The sibling
      ``kvguard_test_cpu_shim-0.0.0.dist-info/entry_points.txt`` registers
      :func:`load` in SGLang's general-plugin group ``sglang.srt.plugins``;
      importlib.metadata finds dist-info directories on any sys.path entry, so no
      pip install is needed. SGLang calls ``load_plugins()`` in the launcher and at
      the start of every scheduler process (``run_scheduler_process``), from 0.5.15
      on (checked in 0.5.19 and 0.5.23 wheels) -- early enough for both roles.
This file never touches SGLang source files; it is not shipped in the package.
"""
import os
import sys

_DONE = False


def load() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    from sglang.srt.disaggregation.mooncake import conn

    sender = getattr(conn, "MooncakeKVSender", None)
    if sender is not None and hasattr(sender, "supports_host_tensor_indices"):
        sender.supports_host_tensor_indices = False
        state = "set MooncakeKVSender.supports_host_tensor_indices=False"
    else:
        state = "no-op (this release has no supports_host_tensor_indices)"
    # One line per process so a test can prove the shim ran where it matters.
    print(f"[kvguard-test-cpu-shim] pid={os.getpid()} {state}", file=sys.stderr, flush=True)
