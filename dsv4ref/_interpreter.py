"""A faster Triton interpreter, same results: one language patch per launch instead of one per helper call, and
one dtype table instead of one per operation.

Triton's interpreter (3.9.0, the version this was written against) swaps ``triton.language``'s builtins for numpy versions when a kernel launches, and
again on every call of a ``@triton.jit`` helper inside the kernel: each call walks the members of
``tl``, ``tl.tensor`` and ``tl.math`` (``inspect.getmembers``) to re-patch what the launch already patched.
dsv4ref's kernels call small helpers (``bf16_round_nan``, ``page_offsets``, ...) many times per program, and
the walk costs more than most of the helpers it precedes.

:func:`patch_helper_calls` skips the walk for a helper whose language modules (``tl`` / ``tl.core`` among its
globals) the running launch has patched already, by itself or at an earlier helper call (a helper's patch is
never undone before the launch ends: Triton drops its record); any other call patches as before. The launch's
own patch and its restore are untouched, so the state of ``triton.language`` inside and after a launch is what
it was.
Where the interpreter's helper call is not the one this was written against (its code is compared line by
line), nothing is changed.

:func:`cache_dtype_table`: the interpreter maps a Triton dtype to its numpy dtype (``_get_np_dtype``) by
building a 19-entry dict on every call, about once per operand of every operation; a table filled once from
that same function gives the same answers for a tenth of the time.
"""

from __future__ import annotations

import inspect


# InterpretedFunction.__call__ as written in Triton 3.9.0, comments and blank lines dropped
_HELPER_CALL = [
    "def __call__(self, *args, **kwargs):",
    "_patch_lang(self.fn)",
    "fn = self.rewrite()",
    "try:",
    "return fn(*args, **kwargs)",
    "except Exception as e:",
    "raise InterpreterError(repr(e)) from e",
]


def _code(fn) -> list[str]:
    try:
        lines = inspect.getsource(fn).splitlines()
    except (OSError, TypeError):
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _modules():
    """``(triton.language, triton.runtime.interpreter)``, or None where Triton has no interpreter module."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return None
    return tl, interp


def _lang_ids(fn, tl) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def cache_dtype_table() -> bool:
    """Install the dtype table (idempotent). Returns False, changing nothing, where the interpreter has no
    ``_get_np_dtype``."""
    if (modules := _modules()) is None:
        return False
    tl, interp = modules
    build = getattr(interp, "_get_np_dtype", None)
    if build is None:
        return False
    if getattr(build, "dsv4ref_builder", None) is not None:  # installed already
        return True
    table: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # a block's numpy dtype is its element's (unhashable: unwrap)
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return build(tt_dtype)
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = build(tt_dtype)
        return found

    np_dtype.dsv4ref_builder = build  # Triton's own function, which fills the table (and the tests compare to)
    interp._get_np_dtype = np_dtype
    return True


def patch_helper_calls() -> bool:
    """Install the skip (idempotent). Returns False, changing nothing, where the interpreter differs."""
    if (modules := _modules()) is None:
        return False
    tl, interp = modules
    grid, helper = getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction", None)
    needed = (
        grid is not None
        and helper is not None
        and callable(getattr(interp, "_patch_lang", None))
        and hasattr(interp, "InterpreterError")
        and _code(helper.__call__) == _HELPER_CALL
    )
    if getattr(interp, "_dsv4ref_patched", False):
        return True
    if not needed:
        return False

    active: list[set] = []  # the language modules patched so far in the running launch(es)
    langs: dict = {}  # helper function -> the ids of the language modules among its globals
    launch = grid.__call__

    def grid_call(self, *args, **kwargs):
        active.append(set(_lang_ids(self.fn, tl)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    def helper_call(self, *args, **kwargs):
        mine = langs.get(self.fn)
        if mine is None:
            mine = langs[self.fn] = _lang_ids(self.fn, tl)
        if not (active and mine <= active[-1]):
            interp._patch_lang(self.fn)
            if active:
                active[-1] |= mine
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    grid.__call__ = grid_call
    helper.__call__ = helper_call
    interp._dsv4ref_patched = True
    return True
