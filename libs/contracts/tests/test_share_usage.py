"""Shares sized from use (``gpu_memory_mib: auto``) and simulated usage that changes while a job runs."""

from __future__ import annotations

import pytest
from gpuorch_contracts import AUTO_SHARE_DEFAULT_MIB, GpuRequest
from gpuorch_contracts.simulated_usage import parse_usage
from pydantic import ValidationError


def test_auto_memory_is_a_share_with_the_default_size_until_the_api_sizes_it() -> None:
    auto = GpuRequest.model_validate({"gpu_memory_mib": "auto", "gpu_milli": 250})
    assert auto.gpu_memory_auto and auto.gpu_memory_mib == AUTO_SHARE_DEFAULT_MIB and auto.kind == "share"
    assert GpuRequest.model_validate_json(auto.model_dump_json()) == auto
    sized = GpuRequest.model_validate({"gpu_memory_auto": True, "gpu_memory_mib": 2048})
    assert sized.gpu_memory_mib == 2048  # its own default without history
    with pytest.raises(ValidationError):
        GpuRequest.model_validate({"gpu_memory_mib": "auto", "gpus": 1})


def test_declared_memory_can_change_while_the_process_runs() -> None:
    usage = parse_usage("util=40,mem_mib=3000,mem_mib_from=20:1000/4:30720,bogus")
    assert usage.mem_steps == ((4.0, 30720), (20.0, 1000))
    assert [usage.memory_at(age) for age in (0, 3.9, 4, 19, 25)] == [3000, 3000, 30720, 30720, 1000]
    assert usage.at_age(5).mem_mib == 30720 and usage.at_age(5).mem_steps == ()
    assert parse_usage("mem_mib_from=x:1,2").mem_steps == () and parse_usage("util=5").memory_at(9) is None
