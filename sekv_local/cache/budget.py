"""Turning a `--budget` (fraction of full-KV bytes, or bytes) into token counts for token-level methods."""

from __future__ import annotations

from ..errors import BudgetError, SekvError
from ..models.config import ModelConfig


_UNITS = {"gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "gb": 10 ** 9, "mb": 10 ** 6, "kb": 10 ** 3, "b": 1}


def parse_budget(text: str) -> float | int:
    """'0.25' or '25%' -> fraction of full-KV bytes (float); '64MiB' / '500KB' / '123456' -> bytes (int)."""
    clean = text.strip().lower().replace(" ", "")
    try:
        if clean.endswith("%"):
            fraction = float(clean[:-1]) / 100
        else:
            for unit, scale in _UNITS.items():
                if clean.endswith(unit):
                    return int(float(clean[: -len(unit)]) * scale)
            number = float(clean)
            if number > 1:
                return int(number)
            fraction = number
    except ValueError:
        raise SekvError(f"'{text}' is not a budget (examples: 0.25, 25%, 64MiB)") from None
    if not 0 < fraction <= 1:
        raise SekvError(f"a fractional budget must be in (0, 1], got {text}")
    return fraction


def resolve_budget_bytes(budget: float | int | None, config: ModelConfig, planned_tokens: int, method: str) -> int:
    """Device-tier byte limit: a float in (0, 1] is a fraction of the full-KV bytes of `planned_tokens`."""
    if budget is None:
        raise SekvError(f"{method}: needs a --budget (fraction of full-KV bytes like 0.25, or bytes like 64MiB)")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise SekvError(f"{method}: a fractional budget must be in (0, 1], got {budget}")
        return int(budget * config.full_kv_bytes(planned_tokens))
    if budget <= 0:
        raise SekvError(f"{method}: budget must be positive")
    return int(budget)


def budget_tokens(budget_bytes: int, bytes_per_token: int, minimum: int, method: str) -> int:
    """Tokens that fit in `budget_bytes`; refuses when fewer than `minimum` fit."""
    tokens = budget_bytes // bytes_per_token
    if tokens < minimum:
        raise BudgetError(f"{method}: a budget of {budget_bytes / 2**20:.2f} MiB holds {tokens} tokens "
                          f"({bytes_per_token} bytes each); it needs at least {minimum}. Raise --budget.")
    return tokens
