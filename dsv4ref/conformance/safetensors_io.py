"""Golden vectors in a language-neutral format: one ``.safetensors`` file per case, beside the ``.pt`` one.

safetensors is a flat file: an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range, plus a ``__metadata__`` map of strings), then the raw little-endian tensor bytes. A
C++ or Rust port reads it with a JSON parser and ``memcpy`` — no Python, no pickle (``golden/README.md``
shows how).

A case's file holds

* tensors ``inputs.<name>``, ``expected.<name>`` and ``mass.<name>`` (contiguous copies);
* ``__metadata__``: ``op``, ``case``, ``why``, ``positional`` (a JSON list of argument names passed
  positionally), ``scalars`` (a JSON object of the non-tensor inputs: numbers, booleans, null, small
  dicts; a non-finite float as ``{"float": "inf"}``, a dtype as ``{"dtype": "float32"}``), ``tolerance`` (JSON: output name → {name, mode, atol, rtol, cos}), ``check_values``
  ("true" / "false": whether the case runs with the library's value checks on).
"""

from __future__ import annotations

import json
import math
import pathlib

import torch

from .suite import Case, tolerance_record


def _jsonable(v):
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}  # e.g. {"dtype": "float32"}
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}  # JSON has no inf / nan: spelled out, read back by _from_json
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _from_json(v):
    if isinstance(v, dict) and set(v) == {"float"}:
        return float(v["float"])
    if isinstance(v, dict) and set(v) == {"dtype"}:
        return getattr(torch, v["dtype"])
    if isinstance(v, dict):
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


def save(directory, cases: list[Case]) -> list[pathlib.Path]:
    """Write ``directory/<op>__<case>.safetensors`` for each case (expected outputs must be filled in)."""
    from safetensors.torch import save_file

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in cases:
        tensors, scalars = {}, {}
        for k, v in c.inputs.items():
            if isinstance(v, torch.Tensor):
                tensors[f"inputs.{k}"] = v.detach().cpu().contiguous().clone()
            else:
                scalars[k] = v
        for group, values in (("expected", c.expected), ("mass", c.mass)):
            for k, v in values.items():
                tensors[f"{group}.{k}"] = v.detach().cpu().contiguous().clone()
        meta = {
            "op": c.op,
            "case": c.name,
            "why": c.why,
            "positional": json.dumps(list(c.positional)),
            "scalars": json.dumps(_jsonable(scalars)),
            "tolerance": json.dumps(_jsonable(tolerance_record(c))),
            "check_values": "true" if c.check_values else "false",
        }
        p = d / f"{c.op}__{c.name}.safetensors"
        save_file(tensors, str(p), metadata=meta)
        paths.append(p)
    return paths


def load(directory) -> list[Case]:
    """The cases stored by :func:`save` in ``directory`` (stored expected outputs, not recomputed)."""
    from safetensors import safe_open

    cases = []
    for p in sorted(pathlib.Path(directory).glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata()
            groups: dict[str, dict] = {"inputs": {}, "expected": {}, "mass": {}}
            for key in f.keys():
                group, name = key.split(".", 1)
                groups[group][name] = f.get_tensor(key)
        inputs = dict(groups["inputs"]) | _from_json(json.loads(meta["scalars"]))
        positional = tuple(json.loads(meta["positional"]))
        order = list(positional) + [k for k in inputs if k not in positional]
        tol = {o: t["name"] for o, t in json.loads(meta["tolerance"]).items()}
        cases.append(
            Case(
                meta["op"],
                meta["case"],
                {k: inputs[k] for k in order},
                positional,
                groups["expected"],
                tol,
                meta["why"],
                groups["mass"],
                meta["check_values"] == "true",
            )
        )
    return cases
