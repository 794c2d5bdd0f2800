"""A Mooncake transfer engine in its own process (so a test can SIGSTOP it).

Usage: python _mooncake_peer.py NBYTES DUMP_PATH. Prints "<session id> <buffer address>",
then serves stdin commands: "dump" (write the buffer to DUMP_PATH as .npy, print "ok"),
"zero" (clear it, print "ok"), "quit".
"""

import os
import sys

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")

import numpy as np  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine  # noqa: E402


def main() -> None:
    nbytes, dump = int(sys.argv[1]), sys.argv[2]
    engine = MooncakeTransferEngine("127.0.0.1")
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes)
    print(engine.get_session_id(), buf.ctypes.data, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "dump":
            np.save(dump, buf)
            print("ok", flush=True)
        elif cmd == "zero":
            buf[:] = 0
            print("ok", flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
