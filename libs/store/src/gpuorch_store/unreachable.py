"""What PostgreSQL raises while it cannot serve a client yet: a pause to wait out, never a reason to exit.

``DATABASE_UNREACHABLE`` is what a service's start-up waits out (``gpuorch_observability.until_up``): the server is
down or starting (refused, reset, timed out, ``CannotConnectNow``), a session was terminated
(``OperatorIntervention``), every connection slot is taken, or the database is not created yet (a fresh install
whose database another process creates). A wrong password or a missing privilege is not in it: waiting would not
mend those.
"""

from __future__ import annotations

import asyncpg

DATABASE_UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.TooManyConnectionsError,
)
