"""The least a blocking 4 KiB write costs from Python on this machine: a raw
TCP socket pair on loopback, both processes spinning on non-blocking
receives, no protocol beyond sizes. The client sends a 64-byte header and
4 KiB in one send and waits for a 64-byte answer; the server (a forked
process) reads the request whole and answers. Prints t_min and p50 over
20,000 round trips (the first 1,000 dropped).

    .venv/bin/python benches/python_socket_floor.py

docs/BENCHMARKS.md compares quiesce's drop-in and Mooncake's against it.
"""

import os
import socket
import time

N, WARM, HEADER, PAYLOAD = 20_000, 1_000, 64, 4096


def serve(listener):
    c, _ = listener.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.setblocking(False)
    buf = bytearray(HEADER + PAYLOAD)
    view = memoryview(buf)
    while True:
        got = 0
        while got < len(buf):
            try:
                n = c.recv_into(view[got:])
            except BlockingIOError:
                continue
            if n == 0:
                os._exit(0)
            got += n
        c.send(b"s" * HEADER)


def main():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    if os.fork() == 0:
        serve(listener)
    s = socket.create_connection(listener.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    request = b"h" * (HEADER + PAYLOAD)
    clock = time.perf_counter_ns
    times = []
    for _ in range(N):
        t = clock()
        s.send(request)
        got = 0
        while got < HEADER:
            try:
                got += len(s.recv(HEADER - got))
            except BlockingIOError:
                pass
        times.append(clock() - t)
    s.close()
    os.wait()
    times = sorted(times[WARM:])
    print(
        f"raw Python socket pair, both spinning: t_min {times[0] / 1000:.1f} µs, "
        f"p50 {times[len(times) // 2] / 1000:.1f} µs"
    )


if __name__ == "__main__":
    main()
