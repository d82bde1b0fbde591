"""KV cache policies: one file per method behind the `CachePolicy` interface."""

from .base import CachePolicy, MemoryReport, register_policy, create_policy, available_policies  # noqa: F401
from . import full, streaming, sentencekv, quant, h2o, snapkv, pyramidkv, chunkkv, xkv  # noqa: F401  (each registers its methods)
from ..sekv import policy as _sekv_policy  # noqa: F401,E402  (registers "sekv")
from ..metasoft import policy as _metasoft_policy  # noqa: F401,E402  (registers "metasoft")
