"""quiesce standing in for Mooncake's ``mooncake`` package (see
``quiesce.as_mooncake``): ``mooncake.engine`` is quiesce's drop-in; every
other module comes from Mooncake's own package where it is installed."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

try:  # what Mooncake's own package exports at its top
    from mooncake.buffer_pool import BufferPool, RegisteredBufferPool  # noqa: F401
except ImportError:
    pass
