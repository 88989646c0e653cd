"""``python -m kpt.bench``: the benchmark's command line (`kpt.bench.command`)."""

from .command import main

if __name__ == "__main__":
    raise SystemExit(main())
