from gpuorch_dst.cli import main

raise SystemExit(main())
