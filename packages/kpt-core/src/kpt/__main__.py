"""``python -m kpt``: the ``kpt`` command (`kpt.cli`), for where ``kpt`` on the PATH is another program."""

import sys

from .cli import main

sys.exit(main())
