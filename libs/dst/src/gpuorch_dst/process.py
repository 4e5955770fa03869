"""What every simulated process shares: being up, paused or down, and its broker connection.

    crash()      down at once: what it held in memory is gone, its connection drops (unacked deliveries are
                 redelivered), every timer it had set is void
    restart()    a new incarnation: ``on_start`` (recover from what is durable), a new connection
    pause()      SIGSTOP, a VM stall, a long GC: its actions wait; ``resume()`` runs them, late, in order
    disconnect() the broker connection drops; ``reconnect()`` after the fault's duration gives a new one

Actions are scheduled through ``schedule`` so that a crash voids them and a pause delays them.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuorch_dst.broker import SimBroker
from gpuorch_dst.loop import SimLoop


class SimProcess:
    def __init__(self, loop: SimLoop, broker: SimBroker, name: str, skew_s: float = 0.0) -> None:
        self.loop, self.broker, self.name = loop, broker, name
        self.skew_s = skew_s
        """This host's wall clock minus true time (clock skew between hosts)."""
        self.up = False
        self.paused = False
        self.incarnation = 0
        self.connection: int | None = None
        self._deferred: list[tuple[int, Callable[[], None]]] = []

    @property
    def wall(self) -> float:
        """This host's wall clock (decisions and events are dated with it)."""
        return self.loop.now + self.skew_s

    @property
    def running(self) -> bool:
        return self.up and not self.paused

    def schedule(self, delay: float, action: Callable[[], None], label: str) -> None:
        incarnation = self.incarnation
        self.loop.after(delay, lambda: self._run(incarnation, action), f"{self.name}: {label}")

    def _run(self, incarnation: int, action: Callable[[], None]) -> None:
        if incarnation != self.incarnation or not self.up:
            return
        if self.paused:
            self._deferred.append((incarnation, action))
            return
        action()

    # -- faults -----------------------------------------------------------------------------------------------

    def crash(self) -> None:
        if not self.up:
            return
        self.up, self.paused = False, False
        self.incarnation += 1
        self._deferred.clear()
        self.broker.drop(self.connection)
        self.connection = None
        self.on_crash()

    def restart(self) -> None:
        if self.up:
            return
        self.up, self.paused = True, False
        self.incarnation += 1
        self.connection = self.broker.connect()
        self.on_start()

    def pause(self) -> None:
        if self.up:
            self.paused = True

    def resume(self) -> None:
        if not self.up or not self.paused:
            return
        self.paused = False
        deferred, self._deferred = self._deferred, []
        for incarnation, action in deferred:
            self._run(incarnation, action)
        self.on_resume()

    def disconnect(self) -> None:
        if self.up and self.connection is not None:
            self.broker.drop(self.connection)
            self.connection = None
            self.on_disconnect()

    def reconnect(self) -> None:
        if self.up and self.connection is None:
            self.connection = self.broker.connect()
            self.on_reconnect()

    # -- what each kind of process does about it ---------------------------------------------------------

    def on_start(self) -> None: ...

    def on_crash(self) -> None: ...

    def on_resume(self) -> None: ...

    def on_disconnect(self) -> None: ...

    def on_reconnect(self) -> None: ...
