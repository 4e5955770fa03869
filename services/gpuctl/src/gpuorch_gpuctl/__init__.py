"""gpuctl, the command-line client of gpuorch (cli.py). Nothing is imported here: ``gpuctl --version`` loads only
this package and ``__main__``."""


def version_line() -> str:
    """``gpuctl <version>``, from the installed distribution's metadata."""
    from importlib.metadata import version

    return f"gpuctl {version('gpuorch-gpuctl')}"
