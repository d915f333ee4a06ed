"""What one warp's shared-memory instructions of the chunked partial kernel (``hc_chunk_partial_kernel``, pre, T = Hd =
4096) touch, per 64-wide K step, from the layouts Triton 3.6 gives them (benchmarks/mhc.md, "Partial kernel: shared
memory"; the layouts are read off ``triton.compile(...).asm['ttgir']`` and the swizzle off the PTX):

* the stream tile [128, 64] bf16 and the fn tile [64, 128] bf16 are copied by cp.async (LDGSTS.128, 16 B a thread)
  from the blocked layouts #blocked = sizePerThread [1, 8], threadsPerWarp [4, 8] and #blocked1 = [1, 8], [2, 16]
  (8 warps along rows, 4 repeats) into NVMMA shared tiles with the 128-byte swizzle (16-byte chunk c of row r at
  chunk c ^ (r % 8); a 128-column tile is two 64-column halves);
* the stream tile is read back once (LDS.128, #blocked) for Σ X²; the wgmma reads both tiles by descriptor.

For each instruction: the 16-byte pieces' global 32-byte sectors and 128-byte lines (the source side of a cp.async)
and the shared-memory wavefronts of the shared side (128-bit accesses: 4 phases of 8 threads, a phase takes as many
wavefronts as the most 16-byte pieces that share one of its 8 bank groups). ``python benchmarks/experiments/mhc/smem_model.py``
"""

from __future__ import annotations

HD = 4096
K = 4 * HD


def a_rows(w: int, lane: int, j: int) -> tuple[int, int]:
    """#blocked on [128, 64]: (row, first column) of lane ``lane`` of warp ``w``, repeat ``j``."""
    return 32 * j + 4 * w + lane // 8, 8 * (lane % 8)


def b_rows(w: int, lane: int, j: int) -> tuple[int, int]:
    """#blocked1 on [64, 128]."""
    return 16 * j + 2 * w + lane // 16, 8 * (lane % 16)


def swizzled(row: int, col: int, rows: int) -> int:
    """Byte offset of bf16 element (row, col) in an NVMMA 128-byte-swizzled tile of ``rows`` rows."""
    half, c = divmod(col, 64)
    return half * rows * 128 + row * 128 + (((c // 8) ^ (row % 8)) * 16)


def a_global(row: int, col: int, stream_k: bool) -> int:
    """Byte address of stream-tile element (token row, column col): today 4 streams × 16 dims (column r = stream
    r // 16, dim r % 16), ``stream_k`` one stream's 64 dims."""
    i, d = (0, col) if stream_k else divmod(col, 16)
    return ((4 * row + i) * HD + d) * 2


def b_global(row: int, col: int, stream_k: bool, layout: int) -> tuple[int, bool]:
    """(byte address, live) of fn-tile element (row, column): layout 0 split_fn's [G, 3, K, 16], 1 split_fn_wide's
    [K, 128] (the tile [64 K rows, 128 columns]), 2 its transpose (the tile [128 columns, 64 K rows], loaded in
    #blocked as the stream tile); the K rows of today's tile are 4 streams × 16 dims, of ``stream_k``'s one
    stream's 64 dims."""
    if layout == 2:
        row, col = col, row
    k = row if stream_k else (row // 16) * HD + row % 16
    p, g = divmod(col // 16, 2)
    if layout == 2:
        return (col * K + k) * 2, p < 3
    if layout == 1:
        return (k * 128 + col) * 2, p < 3
    return ((g * 3 + p) * K * 16 + k * 16 + col % 16) * 2, p < 3


def wavefronts(offsets: list[int]) -> int:
    """Shared-memory wavefronts of one 128-bit warp access (32 offsets, None = no access)."""
    total = 0
    for q in range(4):
        groups: dict[int, set[int]] = {}
        for off in offsets[8 * q : 8 * q + 8]:
            if off is not None:
                groups.setdefault((off // 16) % 8, set()).add(off // 16)
        total += max((len(s) for s in groups.values()), default=0)
    return total


def instr(rows_fn, glob, tile_rows: int, w: int = 0, j: int = 0) -> tuple[int, int, int, int]:
    """(global sectors, global lines, lines with the zero-filled (masked) pieces' too, shared wavefronts) of one
    warp's 16-byte-per-thread access."""
    sectors, lines, all_lines, offs = set(), set(), set(), []
    for lane in range(32):
        r, c = rows_fn(w, lane, j)
        addr, live = glob(r, c)
        all_lines.add(addr // 128)
        if live:
            sectors.add(addr // 32)
            lines.add(addr // 128)
        offs.append(swizzled(r, c, tile_rows))
    return len(sectors), len(lines), len(all_lines), wavefronts(offs)


def main() -> None:
    print("per warp and 64-wide K step (4 repeats of each access); sectors / lines: the cp.async's global side,")
    print("wavefronts: its shared side (ideal 4 per 512-byte warp access)\n")
    print(
        f"{'candidate':28s} {'access':26s} {'instr':>5s} {'sectors':>8s} {'lines':>6s} {'+ zero-fill':>12s} "
        f"{'smem wavefronts':>16s}"
    )
    for name, sk, lay in (
        ("today (BK 16, 4 streams)", False, 0),
        ("sk64", True, 0),
        ("fnwide", False, 1),
        ("fnkmajor", False, 2),
        ("sk64 fnwide", True, 1),
        ("sk64 fnkmajor", True, 2),
    ):
        rows = [
            ("stream tile cp.async", instr(a_rows, lambda r, c: (a_global(r, c, sk), True), 128)),
            (
                "fn tile cp.async",
                instr(a_rows if lay == 2 else b_rows, lambda r, c: b_global(r, c, sk, lay), 128 if lay == 2 else 64),
            ),
            ("stream tile LDS (Σ X²)", (0, 0, 0, wavefronts([swizzled(*a_rows(0, lane, 0), 128) for lane in range(32)]))),
        ]
        for what, (s, ln, la, wf) in rows:
            print(f"{name:28s} {what:26s} {4:5d} {4 * s:8d} {4 * ln:6d} {4 * la:12d} {4 * wf:16d}")


if __name__ == "__main__":
    main()
