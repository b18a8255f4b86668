"""Errors every layer may raise; each names the bad value and the fix."""


class ConfigError(ValueError):
    """A configuration value is missing, malformed or impossible."""
