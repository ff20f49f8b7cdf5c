"""A quiesce.mooncake peer in its own process, driven over stdin/stdout.

Started as ``python peer.py SIZE [SIZE...]``: initialises a TransferEngine on
``$QUIESCE_TEST_HOSTNAME`` (127.0.0.1 by default; ``host:port`` picks the
port) with protocol ``$QUIESCE_TEST_PROTOCOL`` (tcp by default), registers one buffer per SIZE, prints ``ready PORT`` and one
``region ADDR LEN`` line each, then answers one command a line:

* ``fill ADDR LEN BYTE``   -- sets the bytes; answers ``ok``
* ``count ADDR LEN BYTE``  -- answers how many of the bytes equal BYTE
* ``crc ADDR LEN``         -- answers their CRC-32
* ``unregister ADDR``      -- answers unregister_memory's code
* ``register ADDR LEN``    -- answers register_memory's code
"""

import ctypes
import os
import sys
import zlib

from quiesce.mooncake import TransferEngine


def main() -> None:
    engine = TransferEngine()
    protocol = os.environ.get("QUIESCE_TEST_PROTOCOL", "tcp")
    hostname = os.environ.get("QUIESCE_TEST_HOSTNAME", "127.0.0.1")
    assert engine.initialize(hostname, "P2PHANDSHAKE", protocol, "") == 0
    buffers = [ctypes.create_string_buffer(int(s)) for s in sys.argv[1:]]
    addrs = [ctypes.addressof(b) for b in buffers]
    lens = [len(b) for b in buffers]
    assert engine.batch_register_memory(addrs, lens) == 0
    print(f"ready {engine.get_rpc_port()}")
    for a, n in zip(addrs, lens):
        print(f"region {a} {n}")
    sys.stdout.flush()
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        if w[0] == "fill":
            ctypes.memset(int(w[1]), int(w[3]), int(w[2]))
            print("ok")
        elif w[0] == "count":
            data = ctypes.string_at(int(w[1]), int(w[2]))
            print(data.count(bytes([int(w[3])])))
        elif w[0] == "crc":
            print(zlib.crc32(ctypes.string_at(int(w[1]), int(w[2]))))
        elif w[0] == "unregister":
            print(engine.unregister_memory(int(w[1])))
        elif w[0] == "register":
            print(engine.register_memory(int(w[1]), int(w[2])))
        else:
            print(f"error unknown command {w[0]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
