from gpuorch_gpuctl.cli import app

app()
