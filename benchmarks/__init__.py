"""jamp's benchmarks: ``python -m benchmarks <experiment> [options]`` (``benchmarks/README.md``)."""
