"""The project's benchmarks and checks, run from the repository root as modules
(`python -m tools.bench_service --datastore data/stdlib`) so that they import each other
and the shared `tools.harness` (start and stop `redraft serve`, the record of the machine and
the command each result file starts with) without touching sys.path."""
