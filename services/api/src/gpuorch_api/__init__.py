"""gpuorch API: HTTP for people and programs (see README.md)."""
