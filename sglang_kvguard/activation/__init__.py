"""Activation: installing kvguard in every SGLang process and saying so.

* ``install.py``: plan, install, uninstall (the orchestration: it hands the engine the
  guard registry, the activation hooks and the accounting wrappers);
* ``hooks.py``: the upstream entry points wrapped in every process (SGLang's parser
  gets the ``--kvguard-*`` flags, the scheduler and detokenizer log the banner);
* the entry points ``sglang_kvguard.plugin`` (SGLang's plugin loader) and
  ``sglang_kvguard.launch_server`` (``kvguard launch``) belong to this layer too.
"""
