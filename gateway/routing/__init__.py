"""Provider selection: overlay snapshot -> capability plan -> groups -> picker -> route decision."""

from gateway.routing.plan import RouteDecision
from gateway.routing.providers import ProviderView
from gateway.routing.router import Router

__all__ = ["ProviderView", "RouteDecision", "Router"]
