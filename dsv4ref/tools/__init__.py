"""dsv4ref's tooling: the check / bench registries and runners (:mod:`.harness`), one module of cases per
op (:mod:`.cases`), and the command line (:mod:`.cli`). Tools import the ops; no op imports tools."""
