"""gpuorch_dst: deterministic simulation testing of the control plane (see README.md).

``run_seed(seed, config)`` plays one seeded run of the real scheduling library's ``Scheduler`` (a leader and a
standby) with simulated executors, node-agents, broker and database under faults, checking the invariants after
every action; ``python -m gpuorch_dst --seeds N`` (``make sim``) runs many.
"""

from gpuorch_dst.invariants import Violation
from gpuorch_dst.simulation import FAULT_KINDS, Outcome, SimConfig, Simulation, run_seed
from gpuorch_dst.stale_commands import EpochGuard, predates_recovery, refuses

__all__ = ["FAULT_KINDS", "EpochGuard", "Outcome", "SimConfig", "Simulation", "Violation", "predates_recovery", "refuses", "run_seed"]
