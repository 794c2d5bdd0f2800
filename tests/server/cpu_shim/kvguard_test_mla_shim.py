"""TEST-ONLY SGLang plugin: serve a DeepSeek-V2 (MLA) model on CPU.

What: registers, in SGLang's DeepSeek ``AttentionBackendRegistry``, that the
      ``torch_native`` attention backend runs every DeepSeek attention forward with
      SGLang's own absorbed-MLA method (``AttnForwardMethod.MLA``).
Why:  ``torch_native`` has no DeepSeek handler, so SGLang falls back to the Triton
      backend's, which picks the MHA method for a fresh prefill; ``torch_native``'s
      MHA path then reads K/V from the latent MLA pool (width kv_lora_rank +
      qk_rope_head_dim) and the first prefill dies with a shape error
      (``attention_backend_handler.py``, ``forward_mha.py``, ``torch_native_backend.py``;
      measured on 0.5.19 and 0.5.23). With the MLA method every forward reads and writes
      the MLA pool that PD transfers, in the layout production uses.
      GPUs prefill fresh prompts through MHA instead; the pool's contents are the same.
How:  enabled only where a test lists it in ``SGLANG_PLUGINS`` (the MLA server tests);
      found through the sibling ``kvguard_test_mla_shim-0.0.0.dist-info`` on
      PYTHONPATH, as the CPU shim is. It never touches SGLang source files and is not
      shipped in the package.
"""
import os
import sys


def load() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)
    print(f"[kvguard-test-mla-shim] pid={os.getpid()} torch_native -> MLA", file=sys.stderr, flush=True)
