"""Usage and budgets (docs/usage-and-budgets.md): the ``usage:`` section (where usage is kept),
the ``budgets`` of keys and orgs, and the ``prices`` of pools.

Keys, orgs and pools hold these models; the check that holds budgets and prices together
(a money budget needs some price) is the root's, which sees them all (``proxy.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, Field, model_validator

from .fields import NonEmptyStr, StrictModel


class BudgetSpec(StrictModel):
    """A cap on an org's or a key's tokens or money per UTC day or calendar month
    (docs/usage-and-budgets.md): requests are refused once it is used up; ``warn_at`` is the
    fraction at which it warns (a log line, the ``sfq_budget_used_ratio`` alert)."""

    period: Literal["day", "month"]
    tokens: int | None = Field(None, gt=0, le=10**15)
    money: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False)
    warn_at: float = Field(0.8, gt=0, lt=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_unit(self) -> Self:
        if (self.tokens is None) == (self.money is None):
            raise ValueError("needs exactly one of tokens, money")
        return self


def _one_budget_per_period_and_unit(budgets: list[BudgetSpec]) -> list[BudgetSpec]:
    """Two budgets of one period and unit: the smaller would be the only one that counts."""
    seen = [(b.period, b.tokens is None) for b in budgets]
    if len(set(seen)) != len(seen):
        raise ValueError("has two budgets of the same period and unit")
    return budgets


Budgets = Annotated[
    list[BudgetSpec], Field(max_length=4), AfterValidator(_one_budget_per_period_and_unit)
]
Price = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class PriceSpec(StrictModel):
    """What a million tokens cost, in the currency of money budgets."""

    prompt_per_1m: Price
    completion_per_1m: Price


class UsageSpec(StrictModel):
    """Where usage is kept (docs/usage-and-budgets.md): in memory mode the SQLite ``file``
    (None: in the process only, lost at restart); with ``state: redis``, in Redis. Written
    every ``flush_s``; kept ``retention_days``: the file's and the process's rows older
    than that are pruned, Redis's hashes expire that long after their last write. At least
    32 days: a month's budget is checked against the month's rows."""

    file: NonEmptyStr | None = None
    flush_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False)
    retention_days: int = Field(400, ge=32, le=3650)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """The Redis-only setting it replaced: said by name rather than as an unknown key."""
        if isinstance(data, dict) and "redis_ttl_days" in data:
            raise ValueError("redis_ttl_days is now retention_days (for every store)")
        return data
