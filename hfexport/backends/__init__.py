"""The backends: one folder per export format, each with its descriptor (`hfexport.backends.descriptor.Backend`).

`backend(name)` is the descriptor of a format; `names()` lists them in order. See `registry` for how one is added.
"""

from hfexport.backends.descriptor import Backend, Ops, Ref, Tools
from hfexport.backends.registry import backend, backends, find, names

__all__ = ["Backend", "Ops", "Ref", "Tools", "backend", "backends", "find", "names"]
