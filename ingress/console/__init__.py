"""The web console at ``/console``: teams, budgets, breaker levels, live usage, worker pools
and probes on one page, team edits and API keys from it; behind the admin key."""

from ingress.console.routes import Console, console_router

__all__ = ["Console", "console_router"]
