"""Test-bed stand-in for ``torchvision``.

Why it exists: the ``torchvision`` wheels on the package index are linked against CUDA
and fail to import next to the CPU build of torch ("operator torchvision::nms does not
exist"), and there is no CPU torchvision wheel matching torch 2.13 on the index. SGLang
imports torchvision at module level (0.5.10/0.5.19 ``srt/utils/common.py`` does
``from torchvision.io import decode_jpeg``; 0.5.23 via its multimodal utilities) but
never uses it on the text-only paths the tests exercise.

Behaviour: every ``torchvision.*`` submodule (``transforms``, ``transforms.v2.functional``,
``io``, ...) is created on demand; attributes are placeholders, so module-level
references such as ``InterpolationMode.BICUBIC`` work, but any CALL raises and is
recorded in ``$KVGUARD_STUB_CALL_LOG`` (see ``_kvguard_stub_support``).

There is no ``torchvision`` dist-info, so ``importlib.metadata.version("torchvision")``
fails and transformers' ``is_torchvision_available()`` reports False.
"""

import sys as _sys

from _kvguard_stub_support import install_package_stub as _install

_install(
    _sys.modules[__name__],
    why="torchvision on the package index is a CUDA build that cannot load beside CPU torch.",
)
del _install, _sys
