"""Pure telemetry logic: no I/O, no clock, no broker.

- ``sizing``: MIG profiles by GPU memory class, weight memory per precision, the smallest fit with headroom;
- ``attribution``: which job a GPU process (and its memory and utilisation) belongs to;
- ``detection``: rules (idle, oversized, starved, throttled, memory pressure, unhealthy GPU) over windows of usage.
"""
