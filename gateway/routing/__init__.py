"""Provider selection: overlay snapshot -> capability plan -> groups -> picker -> route decision."""

from gateway.routing.decision import RouteDecision
from gateway.routing.providers import ProviderView
from gateway.routing.router import Router

__all__ = ["ProviderView", "RouteDecision", "Router"]
