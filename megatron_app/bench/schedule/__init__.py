"""tools/bench_schedule.py's benchmark: schedules head to head on emulated compute (cli: flags and the run;
rows and scenarios: what runs; plan: the runs and their workers; analysis: raw results to rows; targets: the issue's
targets as data; report: table, JSON and chart)."""
