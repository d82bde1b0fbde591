"""SeKV: resolution-adaptive semantic KV cache (docs/DESIGN.md §5).

Context is cut into spans at high-surprisal tokens; each span keeps a small summary on the device and
truncated SVD factors of its keys/values in host RAM; a router picks, per layer and KV head, the spans
the current queries need and rebuilds them at full resolution for one mixed-resolution softmax.
"""

from .config import SekvConfig  # noqa: F401
