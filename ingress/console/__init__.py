"""The web console at ``/console``: teams, budgets, breaker levels, live usage, worker pools
and probes on one page, team edits and API keys from it; behind the admin key."""

from ingress.console.routes import Console, install_console

__all__ = ["Console", "install_console"]
