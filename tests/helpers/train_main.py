"""megatron_app.train's command line as a script, for forked_ranks (which runs a script path on every rank)."""

from megatron_app.train.__main__ import main

if __name__ == "__main__":
    main()
