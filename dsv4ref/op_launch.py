"""How a launch reaches a registered custom op: the one convention every ``…Launch`` dataclass follows.

A public op takes ``launch=`` (a frozen ``…Launch`` dataclass, or None for the measured default), checks its
arguments, and calls its custom op with the launch spread after the tensors and scalars::

    sparse_mla_decode_op(q, cache, ..., scale, *launch.op_args())

The custom op's schema names those trailing arguments exactly as the dataclass names its fields, in field order,
and its body rebuilds the launch with ``…Launch.from_op_args(*values)``. A launch whose ops take different
subsets of its fields lists them per op in ``OP_FIELDS`` (keyed by the custom op's name, without the
``dsv4ref::`` namespace) and passes the op's name: ``launch.op_args("rope_gptj")``. So the schema, the dataclass
and the call agree by construction, and ``tests/test_launch_contract.py`` holds every registered op to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import ClassVar

__all__ = ["OpLaunch"]


class OpLaunch:
    """Mixin of a frozen ``…Launch`` dataclass whose op registers torch custom ops.

    ``OP_FIELDS`` maps each custom op that takes the launch (its name without the ``dsv4ref::`` namespace) to
    the fields its schema receives, in schema order; None there means every field, in declaration order."""

    OP_FIELDS: ClassVar[Mapping[str, tuple[str, ...] | None]] = {}

    @classmethod
    def op_fields(cls, op: str | None = None) -> tuple[str, ...]:
        """The fields the custom op ``op`` receives (``op`` may be omitted when every op takes the same)."""
        table = {name: names or tuple(f.name for f in fields(cls)) for name, names in cls.OP_FIELDS.items()}
        if op is None:
            distinct = set(table.values())
            if len(distinct) == 1:
                return next(iter(distinct))
            raise ValueError(f"op: {cls.__name__} serves ops of different schemas; name one of {tuple(table)}")
        if op not in table:
            raise ValueError(f"op: expected one of {tuple(table)}, got {op!r}")
        return table[op]

    def op_args(self, op: str | None = None) -> tuple:
        """The launch as the trailing arguments of ``torch.ops.dsv4ref.<op>``: the values of
        :meth:`op_fields`, in that order. A field still None (resolved per device or input) cannot travel
        in a schema of ints: resolve the launch first."""
        names = self.op_fields(op)
        values = tuple(getattr(self, n) for n in names)
        unresolved = [n for n, v in zip(names, values) if v is None]
        if unresolved:
            raise ValueError(f"{unresolved[0]}: None cannot reach a custom op; resolve the {type(self).__name__} first")
        return values

    @classmethod
    def from_op_args(cls, *values, op: str | None = None):
        """The inverse of :meth:`op_args`: the launch a custom op's body rebuilds from its trailing arguments
        (fields the op does not take keep their defaults)."""
        names = cls.op_fields(op)
        if len(values) != len(names):
            raise ValueError(f"launch: expected {len(names)} values {names}, got {len(values)}")
        return cls(**dict(zip(names, values)))
