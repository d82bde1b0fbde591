"""Meta-Soft (docs/DESIGN.md §7): learned soft tokens probe the context; dropped tokens are merged, not lost."""

from .. import cache as _cache  # noqa: F401  (the cache package registers "metasoft" and must load first)
