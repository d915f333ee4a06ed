"""Write ``benchmarks/RESULTS.md`` and README.md's results excerpt from the bench logs in ``benchmarks/runs/``.

    python benchmarks/write_results.py           # rewrite both from the logs named below
    python benchmarks/write_results.py --check   # rewrite nothing; exit 1 when either file differs from the logs

Where the figures come from:

* :data:`LOG`: the newest *full* one-run ``python -m dsv4ref bench`` log (every registered op, one device call,
  the ceilings measured at its start). Its first two lines give the device and the ceilings, the table rows
  ``op  shape  time us  GB/s  TFLOP/s  of bound  bytes counted`` (``dsv4ref/tools/cli.py``) the rest; every
  number is copied as the log prints it, never re-rounded.
* :data:`SUPPLEMENTS`: a named log per op whose current default the full bench has no row for. mHC's GPU
  default (``chunked zz slice512 n96 st4``) became the default after that bench, so its pre, fused post + pre and
  head rows are the ``defaults`` rows of the newest ``benchmarks/experiments/mhc`` sweep, a separate call with
  its own copy ceiling (printed in the table's footnote, with the log's name).

Which row is the default (bold in the tables), from the library, not from the log:

* ``kv_cache``: the bench times ``kv_insert_op`` / ``kv_gather_op`` with ``default_launch("insert")`` /
  ``default_launch("gather")`` of ``dsv4ref/kv_cache/launch.py``: the rows without ``launch=``;
* ``rope``: ``dsv4ref.rope.default_launch(interpreted=False)`` resolved (its ``heads_per_prog`` and ``warps``) names the ``rope.fused_mh`` row
  (``rope.fused`` for the per-head kernel, ``heads_per_prog = 0``);
* ``mhc``: ``default_launch(op)`` as the GPU resolves it (``ChunkedLaunch()``) is what the sweep times as ``defaults``; ``mhc.post`` has one design;
* ``sparse_mla``: ``backend="auto"`` picks ``"gluon"`` where ``sparse_mla.gluon.available`` (a Hopper GPU: the
  H200 here), the portable fused kernel (``"triton"``) elsewhere;
* ``indexer``: FP8 ``default_launch()``; MXFP4 the row whose launch (printed in the log) has
  ``fp4_decode`` = ``default_launch().decode()`` and ``logits_pages=None``;
* ``moe``: the bench times ``moe.default_launch``; ``compressor``: one design;
* ``decode``: ``Decoder(graph=False)`` is the default; the graphed step is ``graph=True``.

When a default changes in the library and no new bench has run, ``--check`` fails (the bold row moves, or the
log has no row for it): run the bench, keep its log in ``benchmarks/runs/``, point :data:`LOG` at it, rewrite.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "runs"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

LOG = "2026-12-01_s8_h200_bench.log"  # the newest full one-run bench
# how that log was made: scripts/gpu-check.sh's bench stage (STAGES=bench, no BENCH_OP: every op)
COMMAND = "python3 -m dsv4ref bench --ladder $OUT/sparse_mla_ladder.json"
SUPPLEMENTS = {"mhc": "2026-12-01_s10_h200_call1_mhc_sweep.log"}  # the mHC sweep (mhc_sweep.py), candidates filtered
MHC_DEFAULT = "chunked zz slice512 n96 st4"  # what the sweep's `defaults` rows ran (ChunkedLaunch(), the GPU's default)


# ---- parsing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    op: str
    shape: str
    us: str  # the numbers as the log prints them
    gbs: str
    tflops: str
    frac: str  # percent, without the sign
    note: str = ""


@dataclass
class BenchLog:
    name: str
    device: str
    versions: str
    copy_tbs: str
    bf16_tflops: str
    rows: list[Row] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def find(self, op: str, shape: str) -> Row:
        """The row of ``op`` whose shape is ``shape``, else the one whose shape starts with ``shape`` and a space."""
        hits = [r for r in self.rows if r.op == op and r.shape == shape] or [
            r for r in self.rows if r.op == op and r.shape.startswith(shape + " ")
        ]
        if len(hits) != 1:
            raise LookupError(f"{self.name}: {len(hits)} rows for op {op!r} shape {shape!r} (want 1)")
        return hits[0]


_DEVICE = re.compile(r"^(\w+) \((.+)\); (torch \S+); (triton \S+)$")
_CEIL = re.compile(r"^ceilings measured now: copy ([\d.]+) TB/s \(read \+ write\), bf16 matmul (\d+) TFLOP/s$")
# op and shape, then the four numbers of cli.py's row format, two spaces, the note
_ROW = re.compile(r"^(?P<head>\S.*?)\s+(?P<us>\d+\.\d)\s+(?P<gbs>\d+)\s+(?P<tflops>\d+\.\d)\s+(?P<frac>\d+\.\d)%  (?P<note>.*)$")
# the shape's first token: key=value (T=64, S=65536, r=4) or the decode step's "tiny"; op names hold neither
_SHAPE_START = re.compile(r"(?:^|\s)(?=[A-Za-z_]\w*=|tiny\b)")


def split_head(head: str) -> tuple[str, str]:
    """``"mhc.pre one-pass T=4096 Hd=4096 s3: ..."`` -> ``("mhc.pre one-pass", "T=4096 Hd=4096 s3: ...")``."""
    m = _SHAPE_START.search(head)
    if m is None or m.end() == 0:
        raise ValueError(f"no shape in {head!r}")
    return head[: m.start()].strip(), head[m.end() :].strip()


def parse_bench(text: str, name: str = "<log>") -> BenchLog:
    """The device, the ceilings and every row of a ``python -m dsv4ref bench`` log; warnings between rows
    are skipped, ``... FAILED ...`` lines kept in ``failed``."""
    device = versions = copy = bf16 = None
    rows, failed = [], []
    for line in text.splitlines():
        if device is None and (m := _DEVICE.match(line)):
            device, versions = f"{m[2]} ({m[1]})", f"{m[3]}, {m[4]}"
        elif copy is None and (m := _CEIL.match(line)):
            copy, bf16 = m[1], m[2]
        elif copy is not None and (m := _ROW.match(line)) and (h := _SHAPE_START.search(m["head"])) and h.end():
            op, shape = split_head(m["head"])  # (a line with no op before a shape is a warning, not a row)
            rows.append(Row(op, shape, m["us"], m["gbs"], m["tflops"], m["frac"], m["note"]))
        elif ": FAILED " in line:
            failed.append(line.strip())
    if device is None or copy is None:
        raise ValueError(f"{name}: no device line or no ceilings line: not a `python -m dsv4ref bench` log")
    return BenchLog(name, device, versions, copy, bf16, rows, failed)


@dataclass
class MhcSweep:
    name: str
    copy_tbs: str
    rows: dict  # op ("pre", "fused", "head") -> (µs, TB/s, % of copy) of the `defaults` rows at T = Hd = 4096
    small: dict  # op -> µs of the `defaults` rows at T = 37


def parse_mhc_sweep(text: str, name: str = "<log>") -> MhcSweep:
    m = re.search(r"copy ceiling \(512 MiB\) ([\d.]+) TB/s", text)
    rows = {g[0]: g[1:] for g in re.findall(r"^(pre|fused|head)\s+defaults\s+\S+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) %", text, re.M)}
    small = dict(re.findall(r"^(pre|fused|head)\s+T=37\s+defaults\s+\S+\s+([\d.]+) µs", text, re.M))
    if m is None or len(rows) != 3 or len(small) != 3:
        raise ValueError(f"{name}: not an mHC sweep with `defaults` rows for pre, fused and head")
    return MhcSweep(name, m[1], rows, small)


# ---- what the tables show ----------------------------------------------------------------------------------


@dataclass
class Line:
    """One table row: the design, then the row's figures (from the bench, or given)."""

    design: str
    row: Row
    default: bool = False
    beside: list[str] = field(default_factory=list)
    goal: Decimal | None = None  # % of the bound
    mark: str = ""  # footnote mark after the figures
    bytes_cell: str = ""  # overrides the GB/s cell (a supplement's TB/s)
    short: str = ""  # how README.md's excerpt names it (headline lines only)


@dataclass
class Section:
    op: str
    goal: str
    lines: list[Line]
    notes: list[str] = field(default_factory=list)
    headline: list[int] = field(default_factory=lambda: [0])  # the lines README.md quotes
    fractions: bool = True  # README.md quotes their fraction of the bound


_PEERS = (
    ("[torch.compile]", "torch.compile"),
    ("[torch eager]", "torch eager"),
    (" (torch reference)", "torch eager"),
    ("[same-size copy uint8]", "same-size uint8 copy"),
    ("[same-size copy bf16->e4m3]", "same-size bf16→e4m3 copy"),
)


def cite(r: Row) -> str:
    return f"{r.us} µs ({r.frac} %)"


def peers(log: BenchLog, r: Row) -> list[str]:
    """The rows the bench times beside ``r``: its torch reference compiled / eager, a same-size copy."""
    out = []
    for suffix, label in _PEERS:
        hits = [p for p in log.rows if p.op == r.op + suffix and p.shape == r.shape]
        out += [f"{label} {cite(p)}" for p in hits]
    return out


def line(log: BenchLog, design: str, op: str, shape: str, default=False, goal=None, beside=(), short="", own_peers=True) -> Line:
    r = log.find(op, shape)
    extra = [f"{label} {cite(log.find(o, s))}" for label, o, s in beside]
    return Line(
        design, r, default, (peers(log, r) if own_peers else []) + extra, Decimal(goal) if goal is not None else None, short=short
    )


def library_defaults() -> dict:
    """The defaults the tables mark, read from the library (see the module docstring)."""
    import dsv4ref  # noqa: F401  (first: it picks the device)
    from dsv4ref import indexer, kv_cache, rope

    r = rope.default_launch(interpreted=False)  # the GPU's default, also when this script runs on a CPU
    return {
        "insert": kv_cache.default_launch("insert", interpreted=False),
        "gather": kv_cache.default_launch("gather", interpreted=False),
        "rope": (r.heads_per_prog, r.warps),
        "fp4_decode": indexer.default_launch(interpreted=False).decode(),
    }


def _kv(L) -> str:
    return f"{L.tokens_per_program} tokens × {L.num_warps} warps"


def sections(log: BenchLog, mhc: MhcSweep, lib: dict) -> list[Section]:
    out = []
    kv = [
        line(log, f"insert ({_kv(lib['insert'])})", "kv_cache.insert", f"S={s} B=64", True, 80, short="insert, 64k slots")
        for s in (65536, 262144)
    ]
    kv[1:1] = [line(log, f"gather ({_kv(lib['gather'])})", "kv_cache.gather", "S=65536 B=64", True, short="gather")]
    kv.append(line(log, f"gather ({_kv(lib['gather'])})", "kv_cache.gather", "S=262144 B=64", True))
    best = max((r for r in log.rows if r.op == "kv_cache.insert" and "launch=" in r.shape), key=lambda r: Decimal(r.frac))
    kv.append(Line(f"insert, fastest other launch ({best.note})", best, goal=Decimal(80)))
    out.append(Section("kv_cache", "insert ≥ 80 % of copy", kv, headline=[0, 1]))

    hpp, warps = lib["rope"]
    shape = "T=4096 H=64 B=64"
    op, sh = ("rope.fused_mh", f"{shape} hpp={hpp} warps={warps}") if hpp else ("rope.fused", f"{shape} warps={warps}")
    rope = [
        line(
            log,
            f"fused, {hpp} heads × {warps} warps per program" if hpp else f"fused, per head, {warps} warps",
            op,
            sh,
            True,
            70,
            short="fused Q-norm + RoPE + KV insert",
            beside=[("torch.compile", "rope.fused[torch.compile]", shape)] if hpp else (),
        )
    ]
    if hpp:
        rope.append(line(log, "fused, one head per program, 1 warp", "rope.fused", f"{shape} warps=1", goal=70))
    best = max((r for r in log.rows if r.op == "rope.fused_mh" and r is not rope[0].row), key=lambda r: Decimal(r.frac))
    rope.append(Line("fused, fastest other launch (" + best.shape[len(shape) + 1 :] + ")", best, goal=Decimal(70)))
    rope.append(line(log, "three separate passes (Q-norm + RoPE, RoPE of kv, insert)", "rope.three_passes", shape))
    out.append(Section("rope", "fused Q-norm + RoPE + KV insert ≥ 70 % of copy", rope))

    ms = []
    for key, op, goal in (("pre", "mhc.pre", 50), ("fused", "mhc.fused_post_pre", 50), ("head", "mhc.head", None)):
        us, tbs, frac = mhc.rows[key]
        r = Row(op, "T=4096 Hd=4096", us, "", "", frac)
        prev = log.find(f"{op} chunked", "T=4096 Hd=4096 chunked zz slice512:")
        beside = [
            f"torch.compile {cite(log.find(op + '[torch.compile]', 'T=4096 Hd=4096'))}",
            f"the previous default (zz slice512) {cite(prev)}",
        ]
        name = {"pre": "pre", "fused": "fused post + pre", "head": "head"}[key]
        ms.append(
            Line(f"{name}, {MHC_DEFAULT}", r, True, beside, Decimal(goal) if goal else None, "¹", f"{tbs} TB/s", short=name)
        )
    ms.append(line(log, "post (one kernel)", "mhc.post", "T=4096 Hd=4096", True, short="post"))
    small = " / ".join(mhc.small[k] for k in ("pre", "fused", "head"))
    ms.append(
        Line(
            f"pre / fused / head, {MHC_DEFAULT}, decode-sized",
            Row("mhc", "T=37 Hd=4096", small, "", "", ""),
            True,
            mark="¹",
            bytes_cell="—",
        )
    )
    out.append(
        Section(
            "mhc",
            "pre and fused post + pre ≥ 50 % of copy",
            ms,
            [
                f"¹ From [`runs/{mhc.name}`](runs/{mhc.name}) (`defaults` rows of the mHC sweep, the same timing harness, "
                f"inputs and byte counts), whose copy ceiling was {mhc.copy_tbs} TB/s: this bench has no row of the "
                "current default. The rows beside them and `post` are this bench's."
            ],
            headline=[0, 1, 3],
        )
    )

    sm = []
    for T, H, K in ((64, 64, 640), (64, 128, 1152), (64, 16, 2048)):
        sh = f"T={T} H={H} K={K}"
        g = line(
            log,
            "Gluon, warp-specialised (`auto` on Hopper)",
            "sparse_mla.gluon",
            sh,
            True,
            35,
            short=f"Gluon at H {H}",
            beside=[("torch.compile", "sparse_mla.fused[torch.compile]", sh)],
        )
        f = line(
            log,
            "portable fused (`auto` elsewhere)",
            "sparse_mla.fused",
            sh,
            own_peers=False,
            beside=[("two-pass", "sparse_mla.two_pass", sh), ("seed", "sparse_mla.seed", sh)],
        )
        sm += [g, f]
    out.append(Section("sparse_mla", "decode ≥ 35 % of the bound (floor)", sm, headline=[0, 2, 4]))

    ix = [line(log, "FP8 keys", "indexer.logits.fp8", "T=64 H=64 n_c=32768 Bc=64", True, 50, short="FP8 logits")]
    fp4 = [
        r
        for r in log.rows
        if r.op.startswith("indexer.logits.mxfp4")
        and f"fp4_decode='{lib['fp4_decode']}'" in r.note
        and "logits_pages=None" in r.note
    ]
    if len(fp4) != 1:
        raise LookupError(f"{log.name}: {len(fp4)} MXFP4 rows with the default decode {lib['fp4_decode']!r}")
    ix.append(
        Line(
            f"MXFP4 keys, `{lib['fp4_decode']}` decode",
            fp4[0],
            True,
            peers(log, log.find("indexer.logits.mxfp4", fp4[0].shape)),
            Decimal(30),
            short="MXFP4 logits",
        )
    )
    for dec in ("nibble", "f16_blocks"):
        r = [
            r
            for r in log.rows
            if r.op.startswith("indexer.logits.mxfp4") and f"fp4_decode='{dec}'" in r.note and "logits_pages=None" in r.note
        ][0]
        ix.append(Line(f"MXFP4 keys, `{dec}` decode", r, goal=Decimal(30)))
    out.append(Section("indexer", "logits: FP8 ≥ 50 %, MXFP4 ≥ 30 % of the bound", ix, headline=[0, 1]))

    moe = [line(log, "stage (FP8 input staging)", "moe.stage", "T=4096 Hd=4096 K=6", True, 80, short="staging")]
    moe += [line(log, "experts (clamped SwiGLU)", "moe.experts", f"T={T} E=256 K=6", True) for T in (64, 4096)]
    out.append(
        Section(
            "moe",
            "stage ≥ 80 % of copy; experts: report",
            moe,
            [
                "At T = 64 the used experts' weights are counted once from DRAM, but the rotated input sets share them, "
                "so part is served from L2: read over 100 % as weight streaming at copy bandwidth."
            ],
        )
    )

    cp = [
        line(log, "compress", "compressor.compress", f"r={r} R=64 Hd=4096, {w}", True, short=f"ratio {r}, boundary step")
        for r in (4, 128)
        for w in ("boundary step", "between boundaries")
    ]
    out.append(Section("compressor", "report (no goal)", cp, headline=[0, 2]))

    dec = []
    for T in (4, 32):
        e = log.find("decode.step", f"tiny T={T} eager, checks off")
        g = log.find("decode.step", f"tiny T={T} graph=True (host + replay)")
        rep = log.find("decode.step", f"tiny T={T} replay alone")
        tps = {x: f"{T / (float(x.us) * 1e-6):.0f} tokens/s" for x in (e, g)}
        dec.append(Line("eager (`Decoder()`; value checks off)", e, True, [tps[e]], short=f"eager at T {T}"))
        dec.append(
            Line(
                "one device graph per step (`graph=True`)",
                g,
                False,
                [f"{tps[g]}; replay alone {rep.us} µs"],
                short=f"graphed at T {T}",
            )
        )
    out.append(
        Section("decode", "the teaching config's whole step, captured as one graph", dec, headline=[0, 1], fractions=False)
    )
    return out


# ---- writing -----------------------------------------------------------------------------------------------


def verdict(ln: Line) -> str:
    if ln.goal is None or not ln.row.frac:
        return ""
    frac = Decimal(ln.row.frac)
    return f"≥ {ln.goal} %: " + ("met" if frac >= ln.goal else f"missed by {ln.goal - frac} points")


def table(sec: Section) -> list[str]:
    out = [
        f"## {sec.op}: {sec.goal}",
        "",
        "| design | shape | µs | GB/s | TFLOP/s | of bound | beside it | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ln in sec.lines:
        r = ln.row
        design = f"**{ln.design}** (default)" if ln.default else ln.design
        frac = f"{r.frac} %{ln.mark}" if r.frac else ln.mark
        out.append(
            f"| {design} | {r.shape} | {r.us}{ln.mark if not r.frac else ''} | {ln.bytes_cell or r.gbs} | "
            f"{r.tflops or '—'} | {frac} | {'; '.join(ln.beside)} | {verdict(ln)} |"
        )
    for n in sec.notes:
        out += ["", n]
    return out + [""]


def render_results(log: BenchLog, mhc: MhcSweep, secs: list[Section]) -> str:
    date = log.name[:10]
    head = [
        "# GPU results",
        "",
        "<!-- written by benchmarks/write_results.py from the logs it names; edit the script or the log, not this file -->",
        "",
        f"**Date** {date}. **Device** {log.device}; {log.versions}. **Log** [`runs/{log.name}`](runs/{log.name}).",
        f"**Ceilings measured in the same run**: copy **{log.copy_tbs} TB/s** (512 MiB, read + write), "
        f"bf16 matmul **{log.bf16_tflops} TFLOP/s** (8192³).",
        f"**Command** (one device call, repository root; `scripts/gpu-check.sh`'s bench stage): `{COMMAND}`.",
        "",
        "Timing: median device-graph replay over input sets rotated past the L2; `torch.compile` rows are the op's",
        "torch reference compiled (static shapes), timed with device events. Of bound = max(bytes / copy,",
        "FLOP / bf16 rate) / time, with the compulsory bytes the log states per row. **Bold**: the library's default",
        "on this device (how each is found: the docstring of `benchmarks/write_results.py`). Experiments and the",
        "runs behind each default: `benchmarks/<op>.md`. Regenerate: `python benchmarks/write_results.py`.",
        "",
    ]
    body = [x for s in secs for x in table(s)]
    return "\n".join(head + body).rstrip() + "\n"


def render_excerpt(log: BenchLog, mhc: MhcSweep, secs: list[Section]) -> str:
    out = [
        BEGIN,
        f"GPU results, with the date, device, command and the ceilings measured in the same run: "
        f"[`benchmarks/RESULTS.md`](benchmarks/RESULTS.md), one table per op, written from the newest full bench "
        f"log by `benchmarks/write_results.py` (this excerpt too). The defaults, {log.name[:10]}, "
        f"{log.device.split(' (')[0]} (copy {log.copy_tbs} TB/s, bf16 {log.bf16_tflops} TFLOP/s), as time = fraction "
        f"of the roofline bound, beside `torch.compile` of the op's torch reference:",
        "",
    ]
    for s in secs:
        parts = []
        for i in s.headline:
            ln = s.lines[i]
            fig = f"{ln.row.us} µs" + (f" = {ln.row.frac} %{ln.mark}" if s.fractions else "")
            extra = [
                f"torch.compile {m}"
                for m in (re.search(r"\((\S+ %)\)$", b)[1] for b in ln.beside if b.startswith("torch.compile "))
            ]
            if verdict(ln):
                extra.append("goal " + verdict(ln))
            if not s.fractions:
                extra = [ln.beside[0].split(";")[0]]
            parts.append(f"{ln.short}: {fig}" + (f" ({'; '.join(extra)})" if extra else ""))
        out.append(f"- **{s.op}**: " + ", ".join(parts))
    out += ["", f"¹ From `benchmarks/runs/{mhc.name}` (copy {mhc.copy_tbs} TB/s in that call), the same day.", END]
    return "\n".join(out)


def splice(readme: str, excerpt: str) -> str:
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return readme[:i] + excerpt + readme[j + len(END) :]


def build(lib: dict | None = None) -> tuple[str, str]:
    """(RESULTS.md, README.md) as the logs give them."""
    log = parse_bench((RUNS / LOG).read_text(), LOG)
    mhc = parse_mhc_sweep((RUNS / SUPPLEMENTS["mhc"]).read_text(), SUPPLEMENTS["mhc"])
    secs = sections(log, mhc, lib or library_defaults())
    return render_results(log, mhc, secs), splice(README.read_text(), render_excerpt(log, mhc, secs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when RESULTS.md or README.md's excerpt differs from what the logs give",
    )
    args = p.parse_args(argv)
    results, readme = build()
    if args.check:
        stale = [f.name for f, want in ((RESULTS, results), (README, readme)) if f.read_text() != want]
        if stale:
            print(
                f"out of date (hand-edited, or a default or log changed): {', '.join(stale)}; "
                "run python benchmarks/write_results.py",
                file=sys.stderr,
            )
            return 1
        return 0
    RESULTS.write_text(results)
    README.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
