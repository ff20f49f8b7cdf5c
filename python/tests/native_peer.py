"""A quiesce.Engine target in its own process, driven over stdin/stdout.

Started as ``python native_peer.py NAME=SIZE [NAME=SIZE...]``: lends one
bytearray per segment, prints ``ready ADDRESS``, then answers one command a
line:

* ``fill NAME BYTE``   -- sets every byte; answers ``ok``
* ``count NAME BYTE``  -- answers how many bytes equal BYTE
* ``revoke NAME``      -- answers ``True`` once no earlier write can land
"""

import os
import sys

import quiesce


def main() -> None:
    engine = quiesce.Engine(
        "127.0.0.1:0", transport=os.environ.get("QUIESCE_TEST_PROTOCOL", "tcp")
    )
    segments = {}
    for spec in sys.argv[1:]:
        name, size = spec.split("=")
        segments[name] = engine.register(name, bytearray(int(size)))
    print(f"ready {engine.address}", flush=True)
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        seg = segments[w[1]]
        if w[0] == "fill":
            seg.buffer[:] = bytes([int(w[2])]) * seg.length
            print("ok")
        elif w[0] == "count":
            print(seg.buffer.count(bytes([int(w[2])])))
        elif w[0] == "revoke":
            print(seg.revoke())
        else:
            print(f"error unknown command {w[0]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
