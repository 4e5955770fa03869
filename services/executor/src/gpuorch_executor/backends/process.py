"""``process`` backend: the spec's argv runs directly under the supervisor, in its own process group.

Isolation: the job's own uid when the node has a pool (``domain.job_users``; its HOME, TMPDIR and default working
directory are then its private ``home/``), GPU visibility through ``CUDA_VISIBLE_DEVICES``/``NVIDIA_VISIBLE_DEVICES``
(UUIDs) and, where the host allows, the cgroup device controller denying every other GPU's device node
(``backends.devices``), host memory and CPU through a cgroup v2 per job when ``cgroups`` is given (see
``backends.cgroups``), a minimal environment (``domain.environment``), and for a share on a node whose MPS
daemon runs its MPS memory and thread limits (``backends.mps``). Signals go to the job's process group, and only after its pid
*and* start time were checked.
"""

from __future__ import annotations

import signal as signals
from pathlib import Path
from typing import ClassVar

from gpuorch_contracts import ProcessRun

from gpuorch_executor.backends.base import Backend, JobLaunch, SupervisedCommand, signal_process_group
from gpuorch_executor.backends.cgroups import CgroupV1, CgroupV2
from gpuorch_executor.backends.devices import DeviceConfinement
from gpuorch_executor.backends.mps import MpsControl
from gpuorch_executor.domain.environment import job_environment
from gpuorch_executor.domain.placement import PlacementRecord
from gpuorch_executor.domain.share_memory import mps_client_environment


class ProcessBackend(Backend):
    runtime: ClassVar[str] = "process"

    def __init__(self, cgroups: CgroupV2 | CgroupV1 | None = None, devices: DeviceConfinement | None = None,
                 mps: MpsControl | None = None) -> None:
        self.cgroups = cgroups
        self.devices = devices
        self.mps = mps

    def prepare(self, job: JobLaunch) -> SupervisedCommand:
        run = job.launch.spec.run
        if not isinstance(run, ProcessRun):
            raise ValueError("the process backend runs ProcessRun specs only")
        if job.executable is None:
            raise ValueError(f"command {run.argv[0]!r} was not found on this node")
        cwd = run.workdir
        if cwd is not None and not Path(cwd).is_absolute():
            raise ValueError(f"workdir {cwd!r} must be an absolute path")
        own_user = job.job_uid is not None
        home = job.home_dir if own_user else None
        env = job_environment(job.launch, job.checkpoint_file, job.executor_env, home=home, uid=job.job_uid)
        pipe = self.mps.pipe_directory() if self.mps is not None else None
        if pipe is not None:
            env.update(mps_client_environment(job.launch, pipe))
        if cwd is None and home is not None:
            cwd = str(home)
        cgroup = None
        device_cgroup = None
        joined: list[str] = []
        notes = []
        name = str(job.launch.placement_id)
        if self.cgroups is not None:
            spec = job.launch.spec
            try:
                cgroup = str(self.cgroups.create(name, cpu_milli=spec.cpu_milli, memory_mib=spec.memory_mib))
            except OSError as exc:
                raise ValueError(f"cannot create the job's cgroup: {exc}") from exc
            joined = [str(path) for path in self.cgroups.companions(name)]
        else:
            notes.append("no cgroup: host memory and CPU limits not enforced")
        if self.devices is not None:
            try:
                v2_cgroup = cgroup if self.cgroups is not None and self.cgroups.kind == "cgroup_v2" else None
                device_cgroup = self.devices.confine(name, [
                    (gpu.gpu_uuid, gpu.gpu_index, gpu.mig_profile is not None) for gpu in job.launch.gpus], v2_cgroup)
            except OSError as exc:
                if cgroup is not None and self.cgroups is not None:
                    self.cgroups.remove(Path(cgroup))
                raise ValueError(f"cannot confine the job to its GPUs: {exc}") from exc
        return SupervisedCommand(
            argv=list(run.argv), env=env, executable=job.executable, cwd=cwd, cgroup=cgroup,
            device_cgroup=device_cgroup, joined_cgroups=joined,
            user={"uid": job.job_uid, "gid": job.job_uid} if own_user else None,
            memory_limited=cgroup is not None and job.launch.spec.memory_mib > 0, notes=notes,
        )

    async def send_signal(self, record: PlacementRecord, signum: int) -> None:
        signal_process_group(record, signum)
        if signum == signals.SIGKILL and record.cgroup:
            _kill_cgroup(record.cgroup)

    def release(self, record: PlacementRecord) -> None:
        if self.cgroups is not None and record.cgroup:
            self.cgroups.remove(Path(record.cgroup))
        if self.devices is not None:
            self.devices.release(record.device_cgroup)


def _kill_cgroup(cgroup: str) -> None:
    """SIGKILL every process left in the job's cgroup, including those that left its process group."""
    try:
        Path(cgroup, "cgroup.kill").write_text("1")
    except OSError:
        pass
