"""Quota model and its Redis enforcement, shared by the ingress, the workers and streams."""

from quota.cancel_limit import CancelRateLimit
from quota.enforcer import Admitted, Lease, QuotaEnforcer, Settled
from quota.fallback import LocalLimiter
from quota.model import Pool, QuotaPolicy, dynamic_factor, pool_of, utilisation_sigma
from quota.teams import Team, get_team, set_team

__all__ = [
    "Admitted",
    "CancelRateLimit",
    "Lease",
    "LocalLimiter",
    "Pool",
    "QuotaEnforcer",
    "QuotaPolicy",
    "Settled",
    "Team",
    "dynamic_factor",
    "get_team",
    "pool_of",
    "set_team",
    "utilisation_sigma",
]
