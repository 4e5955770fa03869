"""gpuctl's heavy commands, apart from the thin client (decision 63): the demo and ``up``/``down`` stack
(stack.py, LocalStack), ``replay``, ``report`` (charts), ``bench``, ``db``, ``setup``, ``schema``, ``mig``,
``reserve``, and the direct paths to PostgreSQL and the broker (direct.py, jobs_view.py).

The thin ``gpuctl`` finds these commands through the ``gpuctl.commands`` entry points (commands.py: one
``LazyCommand`` each, importing nothing heavy); a command's module loads only when it runs. Nothing is imported
here."""
