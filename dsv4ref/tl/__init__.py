"""Interpreter-safe Triton building blocks shared by every dsv4ref kernel.

* :mod:`dsv4ref.tl.numerics`: fp32 → e4m3 / UE8M0 / bf16 encoders, exact powers of two, ``dot``.
* :mod:`dsv4ref.tl.paging`: slot → int64 byte offsets inside a page.
* :mod:`dsv4ref.tl.kv_record`: the one 584-byte KV-cache record encoder (used by ``kv_cache.insert``
  and the fused Q-norm + RoPE + KV insert).

Why each helper exists (the interpreter bug it works around): ``docs/triton_interpreter.md``.
"""

from ..device import interpreting

if interpreting():  # the same results, without re-patching triton.language on every helper call
    # here, not in device.py: importing triton.language while TRITON_INTERPRET is set makes its own helpers
    # interpreted functions, which a process that unsets it afterwards to compile for a GPU cannot use
    from .._interpreter import cache_dtype_table, patch_helper_calls

    patch_helper_calls()
    cache_dtype_table()

from .numerics import (  # noqa: E402, F401
    E4M3_MAX,
    bf16_bits,
    bf16_rne_bits,
    bf16_rne_bits_nan,
    bf16_round,
    bf16_round_nan,
    canonical_nan,
    dot,
    dot_e4m3,
    e2m1_e4m3,
    e4m3_decode,
    e4m3_encode,
    e4m3_nan_codes,
    e4m3_snap,
    e4m3_finite,
    e4m3_ue8m0_blocks,
    e4m3_ue8m0_tile,
    inv_pow2,
    nonfinite,
    page_offsets,
    page_offsets32,
    pow2,
    splat,
    ue8m0_byte,
    ue8m0_byte_bits,
    ue8m0_value,
)
