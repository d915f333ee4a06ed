"""``python -m dsv4ref.conformance``: see :func:`dsv4ref.conformance.main`."""

import sys

from . import main

sys.exit(main())
