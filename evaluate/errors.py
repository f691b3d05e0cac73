"""The one error a configuration raises when it cannot run (imported by the modules that check configurations),
and the one way it ends a command."""

import os
import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def refuse(error: ConfigError) -> NoReturn:
    """End the command with the refusal's one line and exit code 2, for single runs and sweeps alike; with
    HYDRA_FULL_ERROR=1 (Hydra's own switch for full tracebacks) raise it instead, traceback and all."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
