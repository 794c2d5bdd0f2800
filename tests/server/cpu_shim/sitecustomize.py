"""TEST-ONLY: lets the server tier ask a stuck SGLang process for its Python stacks.

This directory is on PYTHONPATH of every test server process (and of the processes
SGLang spawns), so Python imports this module at start-up. With
``KVGUARD_TEST_STACK_DUMPS=1`` (set by tests/server/conftest.py) it registers
``faulthandler`` on SIGUSR2: ``PDDeployment`` sends SIGUSR2 to a role's processes
when that role does not become healthy in time, and every thread's stack lands in
the role's log, next to the tail that the failure report shows. Nothing else.
"""
import os

if os.environ.get("KVGUARD_TEST_STACK_DUMPS") == "1":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
