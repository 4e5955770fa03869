"""gpuorch executor: turns LaunchJob/StopJob commands for this node into supervised processes or containers.

Deliberately imports nothing: ``python -m gpuorch_executor.supervise`` starts once per job and must stay cheap.
Read ``README.md`` for the pipeline; ``entrypoint`` -> ``handlers`` -> ``domain`` from the top down.
"""
