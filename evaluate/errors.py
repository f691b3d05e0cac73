"""The one error a configuration raises when it cannot run (imported by the modules that check configurations),
and the one way it ends a command."""

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def refuse(error: ConfigError) -> NoReturn:
    """End the command with the refusal's one line and exit code 2, for single runs and sweeps alike."""
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
