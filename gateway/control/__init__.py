"""The control plane (docs/control-plane.md): render envelope-v1 overlays from a provider catalogue plus live
health and metrics, and publish them atomically when their semantic revision changes.

spec (the YAML file) -> observe (probes, I/O) -> decide (pure) -> publish (atomic file), driven by runner.
"""

from gateway.control.runner import control_main, run_control
from gateway.control.spec import check_spec

__all__ = ["check_spec", "control_main", "run_control"]
