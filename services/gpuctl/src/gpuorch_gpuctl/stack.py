"""Moved: LocalStack lives in ``gpuorch_gpuctl_ops.stack`` (gpuorch-gpuctl-ops, decision 63). This alias keeps
tests written before the split importing; new code imports the ops module."""

from gpuorch_gpuctl_ops.stack import *  # noqa: F403
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode, free_port

__all__ = ["LocalStack", "SimNode", "free_port"]
