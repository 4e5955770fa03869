"""The ``gpuctl`` script and ``python -m gpuorch_gpuctl``: ``gpuctl --version`` alone is answered before the app is
imported (about the interpreter's start-up time); anything else runs ``cli.main``."""

import sys

from gpuorch_gpuctl import version_line


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        print(version_line())
        return
    from gpuorch_gpuctl.cli import main as run_app

    run_app()


if __name__ == "__main__":
    main()
