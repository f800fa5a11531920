"""Benchmark logic behind tools/bench_*.py: plans, workers, analysis, targets and reports. Sits above train/ (the
layer contract in .importlinter); the tools are thin command-line entry points over it."""
