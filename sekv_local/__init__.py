"""sekv-local: chat with a whole book on your own machine with resolution-adaptive KV caches."""

import os

# MKL (inside torch's CPU build) keeps the buffers of its matrix products in a pool of its own that it never
# gives back: 6-7 MiB after a 3K-token read, memory no method reports and glibc's trim cannot reach
# (sekv_local/allocator.py). Without the pool a torch prefill ran as fast here (13.5-14.0 s against 13.7-14.3 s
# for 3K tokens with SeKV). Set before torch is imported; a user's own setting wins.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

__version__ = "0.1.0"
