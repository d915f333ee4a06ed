"""Loaded first (``-p tests.fast_start`` in pyproject's addopts), before pytest's entry-point plugins.

nbval imports nbformat, which imports jsonschema, which imports ``rfc3987_syntax`` when it is installed (the
notebook stack's format extras bring it): that module compiles an IRI grammar at import, about 1.4 s in every
pytest process (the controller and each worker) for a check no notebook here uses. Marking it absent makes
jsonschema skip that one format, as it does wherever the package is not installed.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)
