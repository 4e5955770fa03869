"""One seed, one run: a small fleet and two scheduler instances under faults, checked after every action.

    SimLoop(seed) ── the one random source and clock ──┬── workload   SubmitJob / CancelJob at random times
                                                       ├── faults     at random times in the fault window
                                                       │              (``FAULT_KINDS``), each healed after a while
                                                       ├── SimBroker  delays, duplicates, redelivery
                                                       ├── SimDatabase  log, outbox, lease (commit failures)
                                                       ├── SchedulerProcess x ``schedulers`` (the real Scheduler)
                                                       └── SimNodeAgent + SimExecutor per node
    after every action: ``Checker.after_each`` (and at commits and takeovers its other checks)
    after the fault window: every fault healed, the fleet settles, then ``Checker.settled`` (liveness)

``run_seed(seed)`` returns an ``Outcome``: ok, or the violated invariant with the step and simulated time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuorch_contracts import (
    TERMINAL_STATES,
    CancelJob,
    GpuInfo,
    GpuRequest,
    JobSpec,
    NodeInventory,
    SubmitJob,
)
from gpuorch_contracts.jobs import Checkpoint, Gang, ProcessRun
from gpuorch_scheduling import LivenessPolicy
from gpuorch_scheduling.scheduler import SchedulerConfig

from gpuorch_dst.broker import BrokerFaults, SimBroker
from gpuorch_dst.database import SimDatabase
from gpuorch_dst.invariants import Checker, Violation
from gpuorch_dst.loop import SimLoop
from gpuorch_dst.node import SimExecutor, SimNodeAgent, Timings, Truth, dated
from gpuorch_dst.process import SimProcess
from gpuorch_dst.scheduler_process import SUBMIT_QUEUE, LeaderTimings, SchedulerProcess

FAULT_KINDS = ("crash", "pause", "disconnect", "database_lost", "node_lost", "clock_jump")


@dataclass(frozen=True)
class SimConfig:
    """The size of a run and which faults and guards it has."""

    nodes: int = 3
    gpus_per_node: int = 2
    schedulers: int = 2
    jobs: int = 12
    fault_window_s: float = 40.0
    settle_s: float = 200.0
    faults_per_s: float = 0.25
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    duplicate_p: float = 0.03
    commit_fail_p: float = 0.03
    ack_lost_p: float = 0.02
    max_skew_s: float = 2.0
    gang_p: float = 0.08
    """Share of jobs that are gangs of two nodes (the CI seeds have them since the gang-rank fix:
    docs/RELIABILITY.md)."""
    buggify_p: float = 0.02
    """Chance of a fault at each fault point in the code (a pause between a step and its commit, ...)."""
    fence_commits: bool = True
    """The database refuses a commit of an epoch older than the lease's."""
    epoch_check: bool = True
    """Executors refuse commands of an epoch older than the newest they accepted (``stale_commands.refuses``)."""
    refuse_launches_before_recovery: bool = True
    """Executors refuse a LaunchJob decided before their last recovery (``stale_commands.predates_recovery``)."""

    def without_epoch_fencing(self) -> SimConfig:
        return replace(self, fence_commits=False, epoch_check=False)


@dataclass
class Outcome:
    seed: int
    ok: bool
    invariant: str | None = None
    detail: str | None = None
    step: int = 0
    at: float = 0.0
    action: str = ""
    stats: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.ok:
            return f"seed {self.seed}: ok ({self.step} steps)"
        return (f"seed {self.seed}: {self.invariant} at step {self.step}, t={self.at:.3f}s "
                f"(after '{self.action}'): {self.detail}")


class _Observer(Checker):
    """The checker, plus the per-operation faults (commit failures, lost acks) drawn from the loop."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim.db, sim.truth, sim.scheduler_config.retention_s)
        self.sim = sim

    def commit_fails(self) -> bool:
        return self.sim.faulty and self.sim.loop.chance(self.sim.config.commit_fail_p)

    def ack_lost(self) -> bool:
        return self.sim.faulty and self.sim.loop.chance(self.sim.config.ack_lost_p)

    def buggify(self, point: str) -> bool:
        if self.sim.faulty and self.sim.loop.chance(self.sim.config.buggify_p):
            self.sim.faults_injected[point] = self.sim.faults_injected.get(point, 0) + 1
            return True
        return False


class Simulation:
    def __init__(self, seed: int, config: SimConfig | None = None,
                 trace: Callable[[str], None] | None = None) -> None:
        """``trace``: told every action and every publish (a replay's ``--trace``)."""
        self.seed, self.config, self.trace = seed, config or SimConfig(), trace
        self.loop = SimLoop(seed)
        rng = self.loop.rng
        self.broker = SimBroker(self.loop, BrokerFaults(duplicate_p=self.config.duplicate_p))
        self.db = SimDatabase(fence_commits=self.config.fence_commits)
        self.truth = Truth()
        self.timings = Timings()
        self.scheduler_config = SchedulerConfig(liveness=LivenessPolicy(
            suspect_after_s=3.0, lost_after_s=8.0, fencing_margin_s=1.0))
        self.faulty = True
        self.checker = _Observer(self)
        self.runtimes: dict[uuid.UUID, float] = {}
        skew = self.config.max_skew_s
        self.schedulers = [
            SchedulerProcess(self.loop, self.broker, self.db, f"scheduler-{k}", self.scheduler_config,
                             LeaderTimings(), self.checker, skew_s=rng.uniform(-skew, skew),
                             monotonic_offset=rng.uniform(0, 1000))
            for k in range(self.config.schedulers)]
        self.checker.schedulers = self.schedulers
        self.executors: list[SimExecutor] = []
        self.agents: list[SimNodeAgent] = []
        for n in range(self.config.nodes):
            inventory = NodeInventory(node_id=f"node-{n}", cpu_milli=64000, memory_mib=256000, gpus=[
                GpuInfo(uuid=f"GPU-{n}-{g}", index=g, model="A100-80GB", memory_total_mib=81920)
                for g in range(self.config.gpus_per_node)])
            host_skew = rng.uniform(-skew, skew)
            executor = SimExecutor(self.loop, self.broker, self.truth, inventory, self.runtimes, self.timings,
                                   self.config.epoch_check, host_skew, self.config.refuse_launches_before_recovery)
            executor.buggify = self.checker.buggify
            self.executors.append(executor)
            self.agents.append(SimNodeAgent(self.loop, self.broker, inventory, self.timings, host_skew,
                                            lambda executor=executor: executor.power))  # type: ignore[misc]
        self.submitted: list[SubmitJob] = []
        self.faults_injected: dict[str, int] = {}
        self.broker.trace = trace
        self._after_each = self.checker.after_each if trace is None else self._traced

    ROUTINE = ("heartbeat", "lead", "relay polls", "supervisors read lease.json", "to scheduler.heartbeats")
    """Actions a trace leaves out (they happen every second on every process)."""

    def _traced(self) -> None:
        if self.trace is not None and not self.loop.label.endswith(self.ROUTINE):
            self.trace(f"{self.loop.now:9.3f} {self.loop.label}")
        self.checker.after_each()

    @property
    def processes(self) -> list[SimProcess]:
        return [*self.schedulers, *self.executors, *self.agents]

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            self._start()
            window = self.config.fault_window_s
            self.loop.run_until(window, self._after_each)
            self._heal()
            end = window + self.config.settle_s
            while self.loop.now < end:
                self.loop.run_until(self.loop.now + 10.0, self._after_each)
                if self._quiet():
                    break
            self.loop.run_until(self.loop.now + 5.0, self._after_each)
            self.checker.settled(self.submitted, self._leader())
        except Violation as violation:
            return Outcome(self.seed, False, violation.invariant, violation.detail, self.loop.steps, self.loop.now,
                           self.loop.label, self.stats())
        return Outcome(self.seed, True, step=self.loop.steps, at=self.loop.now, stats=self.stats())

    def stats(self) -> dict[str, int]:
        return {"steps": self.loop.steps, "launches_refused": sum(e.launches_refused for e in self.executors), "events_logged": len(self.db.log), "commits": self.db.commits,
                "commits_refused": self.db.refused, "takeovers": sum(s.takeovers for s in self.schedulers),
                "commands_refused": sum(e.guard.refused for e in self.executors),
                "redelivered": self.broker.redelivered, "duplicated": self.broker.duplicated,
                "runs": len(self.truth.runs), **{f"fault_{k}": v for k, v in sorted(self.faults_injected.items())}}

    def _start(self) -> None:
        for process in self.processes:
            self.loop.at(self.loop.jitter(0.0, 0.5), process.restart, f"start {process.name}")
        self._workload()
        self._faults()

    def _leader(self) -> SchedulerProcess | None:
        return next((s for s in self.schedulers if s.leading and s.epoch == self.db.lease.epoch), None)

    def _quiet(self) -> bool:
        """Every accepted job ended (or waits) and every submission answered: nothing more will happen."""
        leader = self._leader()
        if leader is None or any(s.job_id not in self.db.known_jobs for s in self.submitted):
            return False
        self.checker.catch_up()
        return all((job.state in TERMINAL_STATES and not job.stopping_nodes) or
                   (job.state == "queued" and job.job_id in leader.scheduler.pending)  # type: ignore[union-attr]
                   for job in self.checker.log_state.jobs.values()) and not self.truth.live

    # -- workload ---------------------------------------------------------------------------------------------

    def _uuid(self) -> uuid.UUID:
        return uuid.UUID(int=self.loop.rng.getrandbits(128), version=4)

    def _workload(self) -> None:
        rng = self.loop.rng
        for _ in range(self.config.jobs):
            shape = rng.random()
            if shape < 0.55:
                resources, gang = GpuRequest(gpus=1), 1
            elif shape < 0.8:
                resources, gang = GpuRequest(gpu_milli=rng.choice([250, 500]), gpu_memory_mib=10000), 1
            elif shape < 1.0 - self.config.gang_p:
                resources, gang = GpuRequest(gpus=self.config.gpus_per_node), 1
            else:
                resources, gang = GpuRequest(gpus=1), 2
            high = rng.random() < 0.2
            spec = JobSpec(name="sim", tenant=rng.choice(["a", "b"]), priority_class="high" if high else "normal",
                           resources=resources, gang=Gang(nodes=gang), preemptible=not high and rng.random() < 0.5,
                           checkpoint=Checkpoint(grace_s=rng.choice([0.0, 1.0, 3.0])), max_requeues=5,
                           run=ProcessRun(argv=["train"]))
            job_id = self._uuid()
            self.runtimes[job_id] = rng.uniform(1.0, 15.0)
            submit = SubmitJob(message_id=self._uuid(), job_id=job_id, spec=spec)
            arrival = rng.uniform(0.5, self.config.fault_window_s * 0.8)
            self.loop.at(arrival, self._submitter(submit), "client submits")
            if rng.random() < 0.15:
                cancel = CancelJob(message_id=self._uuid(), job_id=job_id, reason="cancelled by the sim")
                self.loop.at(arrival + rng.uniform(0.0, 10.0), self._submitter(cancel), "client cancels")

    def _submitter(self, message: SubmitJob | CancelJob) -> Callable[[], None]:
        def send() -> None:
            stamped = message.model_copy(update={"occurred_at": dated(self.loop.now)})
            if isinstance(stamped, SubmitJob):
                self.submitted.append(stamped)
            self.broker.publish(SUBMIT_QUEUE, stamped, publisher="client")
        return send

    # -- faults -----------------------------------------------------------------------------------------------

    def _faults(self) -> None:
        rng, at = self.loop.rng, 0.0
        rate = self.config.faults_per_s
        while rate > 0:
            at += rng.expovariate(rate)
            if at >= self.config.fault_window_s:
                break
            kind = rng.choice(self.config.fault_kinds)
            self.loop.at(at, self._fault(kind), f"fault: {kind}")

    def _fault(self, kind: str) -> Callable[[], None]:
        def inject() -> None:
            rng, loop = self.loop.rng, self.loop
            self.faults_injected[kind] = self.faults_injected.get(kind, 0) + 1
            if kind == "crash":
                process = rng.choice(self.processes)
                process.crash()
                loop.after(rng.uniform(0.1, 6.0), self._restart(process), f"restart {process.name}")
            elif kind == "pause":
                process = rng.choice([*self.schedulers, *self.schedulers, *self.processes])
                process.pause()
                loop.after(rng.uniform(0.2, 8.0), process.resume, f"resume {process.name}")
            elif kind == "disconnect":
                process = rng.choice(self.processes)
                process.disconnect()
                loop.after(rng.uniform(0.1, 6.0), process.reconnect, f"reconnect {process.name}")
            elif kind == "database_lost":
                scheduler = rng.choice(self.schedulers)
                scheduler.database_up = False
                loop.after(rng.uniform(0.2, 5.0), lambda: setattr(scheduler, "database_up", True),
                           f"database back for {scheduler.name}")
            elif kind == "node_lost":
                n = rng.randrange(len(self.executors))
                executor, agent = self.executors[n], self.agents[n]
                executor.lose_power()
                agent.crash()
                loop.after(rng.uniform(1.0, 15.0), self._node_back(executor, agent), f"{executor.node_id} back")
            elif kind == "clock_jump":
                process = rng.choice(self.processes)
                process.skew_s += rng.uniform(-5.0, 5.0)
        return inject

    def _restart(self, process: SimProcess) -> Callable[[], None]:
        return process.restart

    def _node_back(self, executor: SimExecutor, agent: SimNodeAgent) -> Callable[[], None]:
        def back() -> None:
            executor.power = True
            executor.restart()
            agent.restart()
        return back

    def _heal(self) -> None:
        """The fault window is over: everything comes back, and no new fault happens."""
        self.faulty = False
        self.broker.faults.duplicate_p = 0.0
        for executor in self.executors:
            executor.power = True
        for process in self.processes:
            process.restart()
            process.resume()
            process.reconnect()
        for scheduler in self.schedulers:
            scheduler.database_up = True


def run_seed(seed: int, config: SimConfig | None = None, trace: Callable[[str], None] | None = None) -> Outcome:
    return Simulation(seed, config, trace).run()


__all__ = ["FAULT_KINDS", "Outcome", "SimConfig", "Simulation", "run_seed"]
