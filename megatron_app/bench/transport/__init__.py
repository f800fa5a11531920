"""tools/bench_transport.py's benchmark: our transport's backends against gloo, a raw TCP socket and a memcpy (cli:
flags, sections and report; worker: one rank of a section; links: what is measured and through what; netns_pair: two
hosts on one machine; latency_model: the fixed + per-byte fit)."""
