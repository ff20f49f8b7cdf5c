"""What memory the native API takes: plain bytes only."""

import ctypes

import pytest

import quiesce
MiB = 1 << 20


def test_a_buffer_of_python_objects_is_refused(native_peer, eng):
    """A buffer whose items are object pointers (format "O": a ctypes
    py_object array, a numpy array of dtype object) is not bytes to move:
    a read would put a peer's bytes where the interpreter keeps pointers
    (its next decref writes where the peer chose), a write would send this
    process's addresses, and a lent one would let any peer do the first.
    It is refused as bad input. It was taken."""
    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    objects = [memoryview((ctypes.py_object * 8)())]
    np = pytest.importorskip("numpy")
    objects.append(np.empty(8, dtype=object))
    # In a struct too; a field *named* with an O is plain data.
    objects.append(np.zeros(2, dtype=[("n", "i4"), ("o", "O")]))
    for o in objects:
        b = eng.batch()
        for add in (b.read, b.write):
            with pytest.raises(quiesce.InvalidInput, match="Python objects"):
                add(o, kv)
        assert len(b) == 0
        with pytest.raises(quiesce.InvalidInput, match="Python objects"):
            eng.register("objects", o)
    plain = np.zeros(1024, dtype=[("Offset", "i4")])
    b = eng.batch()
    b.write(plain, kv)
    assert b.run()
