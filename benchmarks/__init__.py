"""jamp benchmarks: ``python -m benchmarks [--quick|--tiny] [--out PATH]``."""
