"""The one error every config problem becomes (the CLI turns it into exit code 2)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value: names the dotted key, the value and what was expected."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
