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


class Storage:
    """Memory as torch's UntypedStorage holds it."""

    def __init__(self, n, byte):
        self.mem = bytearray([byte]) * n
        self.c = (ctypes.c_char * n).from_buffer(self.mem)


class StorageTensor:
    """A tensor-like object over a storage it can be given anew, as a torch
    tensor's ``set_()`` or ``.data =`` does (its old storage then goes,
    unless something else holds it)."""

    def __init__(self, n, byte):
        self.storage = Storage(n, byte)
        self.nbytes = n
        self.device = type("Device", (), {"type": "cpu"})()

    def data_ptr(self):
        return ctypes.addressof(self.storage.c)

    def untyped_storage(self):
        return self.storage

    def is_contiguous(self):
        return True


def test_a_tensor_given_other_storage_leaves_the_held_storage_alive(native_peer, eng):
    """A batch holds a tensor's storage, not only the tensor: ``x.set_(y)``
    while the batch runs lets go of the memory the transfer reads. It was
    freed (only the tensor was held)."""
    import gc
    import weakref

    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    x = StorageTensor(4096, 7)
    old = weakref.ref(x.storage)
    b = eng.batch()
    b.write(x, kv)
    x.storage = Storage(16, 0)  # set_()
    gc.collect()
    assert old() is not None, "the memory being moved was freed"
    assert b.run()
    assert t.count("kv", 7) == 4096
    gc.collect()
    assert old() is None, "the outcome let go of it"
