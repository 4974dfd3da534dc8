"""Where forward runs execute: in this process (`local`) or on a Ray cluster (`ray`).

See base.py for the contract, local.py and ray.py for the two executors, and
docs/decisions.md ("Forward runs on a cluster") for why Ray workers are actors."""

from engine.executors.base import (
    EXECUTORS,
    Executor,
    ExecutorOptions,
    ExecutorStats,
    Job,
    make_executor,
)

__all__ = ["EXECUTORS", "Executor", "ExecutorOptions", "ExecutorStats", "Job", "make_executor"]
