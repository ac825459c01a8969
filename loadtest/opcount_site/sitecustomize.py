"""Loaded by Python at start-up when this directory is on PYTHONPATH (loadtest/bench_opcodes.py puts it
there for the gateway it measures, and only then). With GRIDGATE_OPCOUNT set, every process the gateway
forks counts its opcodes (loadtest/opcount.py); the supervisor itself is not traced."""

import os

if os.environ.get("GRIDGATE_OPCOUNT"):
    def _count_in_child() -> None:
        from loadtest.opcount import start_counting

        start_counting(os.environ["GRIDGATE_OPCOUNT"], int(os.environ["GRIDGATE_OPCOUNT_WARM"]),
                       int(os.environ["GRIDGATE_OPCOUNT_REQUESTS"]), float(os.environ["GRIDGATE_OPCOUNT_IDLE"]))

    os.register_at_fork(after_in_child=_count_in_child)
