"""The optional user config file: default settings for `sekv-local chat`.

TOML at ``$SEKV_LOCAL_CONFIG`` if set, else ``<user config dir>/sekv-local/config.toml``
(e.g. ``~/.config/sekv-local/config.toml`` on Linux). Flags given on the command line win over it.
Example::

    model = "smollm2-135m"      # registry name or path to a .gguf file
    engine = "torch"
    method = "sekv"
    budget = "25%"              # as --budget: 0.25, "25%", "64MiB"
    threads = 4
    max_new_tokens = 256
    memory_dir = "~/sekv-memories"   # where the app keeps saved memories
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import SekvError

#: key -> accepted Python types of the TOML value
KEYS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "engine": (str,),
    "method": (str,),
    "budget": (str, int, float),
    "threads": (int,),
    "max_new_tokens": (int,),
    "chunk_size": (int,),
    "device": (str,),
    "temperature": (int, float),
    "seed": (int,),
    "memory_dir": (str,),
}


class ConfigError(SekvError):
    """A config file that cannot be used."""


def config_path() -> Path:
    env = os.environ.get("SEKV_LOCAL_CONFIG")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir("sekv-local")) / "config.toml"


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """The settings in the config file ({} when there is none). Unknown keys and wrong types are
    refused with a message naming the file."""
    path = Path(path) if path is not None else config_path()
    if not path.is_file():
        return {}
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading a config file on Python 3.10 needs `pip install tomli`") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm not in KEYS:
            raise ConfigError(f"config file {path}: unknown setting '{key}' (known: {', '.join(KEYS)})")
        if isinstance(value, bool) or not isinstance(value, KEYS[norm]):
            kinds = " or ".join(t.__name__ for t in KEYS[norm])
            raise ConfigError(f"config file {path}: '{key}' must be {kinds}, got {value!r}")
        out[norm] = value
    return out
