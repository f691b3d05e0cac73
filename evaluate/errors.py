"""The one error a configuration raises when it cannot run (imported by the modules that check configurations)."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""
