"""Test-bed stand-in for ``sgl_kernel`` (SGLang's native CUDA kernel package).

Why it exists: ``sgl-kernel`` / ``sglang-kernel`` ship CUDA-only wheels on the package
index, so they cannot be installed on the CPU test bed, yet SGLang imports them at
module level on paths the tests need -- e.g. 0.5.10's ``mem_cache/memory_pool_host.py``
does ``from sgl_kernel.kvcacheio import ...`` unconditionally, and the CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` as well. None of those functions is
called on the text-only CPU paths the tests exercise.

Behaviour: every ``sgl_kernel.*`` submodule is created on demand and every attribute is
a placeholder that RAISES when called (and records the call in
``$KVGUARD_STUB_CALL_LOG``; see ``_kvguard_stub_support``). ``sgl_kernel.scalar_type``
is deliberately left unimportable so that SGLang's ``get_scalar_types()`` takes its own
``except ImportError`` fallback instead of receiving placeholders. ``torch.ops.sgl_kernel``
is not registered, so SGLang's AMX probe (``hasattr(torch.ops.sgl_kernel, ...)``) stays
False.

A real ``sgl_kernel`` installed in site-packages shadows this stand-in (the .pth file
appends this directory to the END of sys.path).
"""

import sys as _sys

from _kvguard_stub_support import install_package_stub as _install

_install(
    _sys.modules[__name__],
    why="sgl_kernel has no CPU build on the package index.",
    blocked=(__name__ + ".scalar_type",),
)
del _install, _sys
