"""The Gluon names the Hopper kernels are written in, imported once (no kernel here).

On a machine whose Triton has no Gluon, or a Gluon without these Hopper ops, the import fails quietly:
``_gluon`` is None and :data:`IMPORT_ERROR` says why; the kernel modules are then never imported
(:func:`dsv4ref.sparse_mla.gluon.launch.kernels`).
"""

IMPORT_ERROR: BaseException | None = None

try:  # Gluon ships with Triton >= 3.5; the Hopper ops live in its nvidia.hopper namespace
    from triton.experimental import gluon as _gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 - for the kernel modules
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # the names that moved between Triton releases (one bridge, for the kernel modules and for
    # benchmarks/experiments/gather_probe.py): thread_barrier was renamed barrier; cp.async from global to
    # shared memory is async_copy_global_to_shared in Triton 3.6, async_load later
    _bar = getattr(gl, "thread_barrier", None) or gl.barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except Exception as e:  # pragma: no cover - depends on the installed Triton
    _gluon = None
    IMPORT_ERROR = e
