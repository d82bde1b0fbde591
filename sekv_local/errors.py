"""User-facing errors: the CLI prints their message (no traceback) and exits non-zero."""

from typing import Callable


class SekvError(Exception):
    """An error whose message is meant for the user, e.g. a bad file or an impossible budget."""


class ModelError(SekvError):
    """A model file or registry entry that cannot be used."""


class DocumentError(SekvError):
    """A document that cannot be read, or does not fit."""


class Interrupted(SekvError):
    """Ctrl-C stopped long work cleanly (state saved where that makes sense); the message says how to go on."""


class BudgetError(SekvError):
    """A cache budget that cannot hold what the method needs."""


def config_check(prefix: str) -> Callable[[bool, str], None]:
    """need(ok, message) for a settings dataclass: raises SekvError("PREFIX: message") when not ok."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SekvError(f"{prefix}: {message}")

    return need


def reject_unknown(prefix: str, options: dict, known: set[str]) -> None:
    """Refuse settings a method does not have, naming the ones it does."""
    unknown = sorted(set(options) - known)
    if unknown:
        raise SekvError(f"{prefix}: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
