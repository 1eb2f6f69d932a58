"""The one error type of the configuration system, and the problems the model reports."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(Exception):
    """A configuration that must not start: its str is the message shown to the operator."""


@dataclass(frozen=True)
class Problem:
    """One rule broken by a set of values; `fields` are the settings it is about (for attribution)."""

    fields: tuple[str, ...]
    text: str


class SettingsProblems(ConfigError):
    """Raised from the model's validator: pydantic lets non-ValueError exceptions through unchanged,
    so the loader still sees which fields each problem is about and can name their sources."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(p.text for p in problems))
