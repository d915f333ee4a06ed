"""``python -m dsv4ref``: the command line lives in :mod:`dsv4ref.tools.cli`."""

import sys

from .tools.cli import main

sys.exit(main())
