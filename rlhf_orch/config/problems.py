"""What a configuration check reports: a `Problem` names the key, the value and the fix; a
`ConfigError` carries every problem found, so a user fixes everything in one go."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    key: str
    value: object
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.fix}"


class ConfigError(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}")
