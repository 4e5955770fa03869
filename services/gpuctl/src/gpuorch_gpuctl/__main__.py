from gpuorch_gpuctl.cli import main

main()
