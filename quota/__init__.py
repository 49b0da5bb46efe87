"""Quota model and its Redis enforcement, shared by the ingress and the streams app."""

from quota.teams import Team, get_team, set_team

__all__ = ["Team", "get_team", "set_team"]
