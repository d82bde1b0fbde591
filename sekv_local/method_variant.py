"""Method variants on the command line: "sekv@positions=bounded" and "--option sekv:zoom_k=32"."""

from __future__ import annotations

from typing import Any

from .errors import SekvError


def option_value(text: str) -> Any:
    """"16" -> 16, "0.5" -> 0.5, "true"/"false" -> bool, anything else stays text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def split_variant(label: str) -> tuple[str, dict[str, Any]]:
    """A method variant for one run: "xkv@group=2@energy=0.9" -> ("xkv", {"group": 2, "energy": 0.9}).
    The whole label names the variant's rows in the report."""
    base, *assignments = label.split("@")
    options: dict[str, Any] = {}
    for assignment in assignments:
        key, eq, value = assignment.partition("=")
        if not eq or not key.strip():
            raise SekvError(f"method variant '{label}' must look like METHOD@KEY=VALUE (e.g. xkv@group=2)")
        options[key.strip()] = option_value(value.strip())
    return base.strip(), options


def parse_method_options(items: tuple[str, ...] | list[str]) -> dict[str, dict[str, Any]]:
    """["sekv:zoom_k=32", "sekv:energy=0.95"] -> {"sekv": {"zoom_k": 32, "energy": 0.95}}."""
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        method, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or not method or not key:
            raise SekvError(f"--option '{item}' must look like METHOD:KEY=VALUE (e.g. sekv:zoom_k=32)")
        options.setdefault(method.strip(), {})[key.strip()] = option_value(value.strip())
    return options
