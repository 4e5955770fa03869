"""gpuctl, the command-line client of gpuorch (cli.py). Nothing is imported here: ``gpuctl --version`` loads only
this package and ``__main__``."""

__version__ = "0.1.0"
"""The distribution's version (pyproject.toml reads it from here: hatch's dynamic version), so that ``--version``
needs no ``importlib.metadata`` (tens of milliseconds in a large environment)."""


def version_line() -> str:
    """``gpuctl <version>``."""
    return f"gpuctl {__version__}"
