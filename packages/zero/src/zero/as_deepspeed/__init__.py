"""DeepSpeed 0.19.8's import paths, nothing but re-exports of zero's own modules.

Every module here is a DeepSpeed module path (``deepspeed.X`` is ``zero.as_deepspeed.X``) that imports its names
from the zero module that implements them; none defines a function or class (a test walks their syntax trees). The
DeepSpeed names zero does not provide raise ``NotSupportedError`` naming what to use instead, on attribute access
and on ``from deepspeed.X import Y`` (``zero.compat.unsupported``).

Served two ways, one module object per path either way: ``import zero as deepspeed`` (``zero/__init__`` binds
``zero.comm``, ``zero.runtime``, ``zero.utils`` ... to these modules) and, on request,
``zero.install_as_deepspeed()`` / ``zero run --as-deepspeed`` (the import hook serves ``deepspeed.X`` as this
package's ``X``). Named after ``zero run --as-deepspeed``.
"""
