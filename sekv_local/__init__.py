"""sekv-local: chat with a whole book on your own machine with resolution-adaptive KV caches."""

__version__ = "0.1.0"
