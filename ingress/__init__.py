"""The OpenAI-compatible HTTP ingress: auth → classify → admit → produce → stream replies."""

from ingress.app import create_app
from ingress.state import IngressState

__all__ = ["IngressState", "create_app"]
