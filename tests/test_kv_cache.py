"""dsv4ref.kv_cache: the paged 584-byte FP8 KV cache (docs/kv_cache.md, its pitfalls #1 and #8–#11).

The expected bytes are placed by THIS file, from the layout as docs/formats.md draws it (token data at
page·stride + 576·t, scales at page·stride + 576·B + 8·t), using plain Python integers; the library's
own offset helpers are never used to build an expectation.
"""

import pytest
import torch

from dsv4ref import kv_cache as kc
from dsv4ref.kv_cache.variants import persistent
from dsv4ref.kv_cache.variants.persistent import PersistentLaunch
from dsv4ref.device import DEVICE, interpreting
from dsv4ref.fp8 import dequantize_ue8m0, quantize_ue8m0
from dsv4ref.testing import assert_close, generator, poison, randn

BACKENDS = ["reference", "triton"]


# ----------------------------------------------------------------------------------------------------
# helpers: the layout, written out independently
# ----------------------------------------------------------------------------------------------------


def record(kv_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(576 data bytes, 8 scale bytes) of one bf16 row [512] (quantised by the fp8 reference, which
    test_fp8.py holds to a float64 oracle)."""
    q, s = quantize_ue8m0(kv_row[:448].cpu(), backend="reference")
    rope = kv_row[448:].cpu().contiguous().view(torch.uint8)  # little-endian bf16
    return torch.cat([q.view(torch.uint8), rope]), torch.cat([s, torch.zeros(1, dtype=torch.uint8)])


def expected_cache(before: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, B: int):
    """(expected cache bytes, bool mask of the bytes a correct writer touches)."""
    flat = before.cpu().clone().reshape(-1)
    touched = torch.zeros_like(flat, dtype=torch.bool)
    stride = before.stride(0)
    for i, slot in enumerate(slots.cpu().tolist()):
        if slot < 0:
            continue
        page, t = divmod(slot, B)
        data, scales = record(kv[i])
        d0 = page * stride + 576 * t
        s0 = page * stride + 576 * B + 8 * t
        flat[d0 : d0 + 576], flat[s0 : s0 + 8] = data, scales
        touched[d0 : d0 + 576] = True
        touched[s0 : s0 + 8] = True
    return flat.reshape(before.shape), touched.reshape(before.shape)


def random_cache(num_pages: int, B: int, seed: int) -> torch.Tensor:
    """A cache filled with random bytes (not zeros), so a byte the writer forgets, or one it writes
    where it should not, shows up."""
    c = kc.allocate(num_pages, B)
    c.copy_(torch.randint(0, 256, tuple(c.shape), generator=generator(seed), dtype=torch.uint8))
    return c


def kv_rows(T: int, seed: int) -> torch.Tensor:
    """[T, 512] bf16 with real magnitudes: per-64 block scales over 2^-12..2^12 (NoPE and RoPE), plus
    hard rows: amax = 448·2^k blocks, an all-zero row, a negative-zero row, an all-equal row."""
    kv = randn((T, 512), seed=seed, octaves=24, device="cpu")
    if T >= 4:
        kv[0, :448] = 0.0  # every block byte 105, all e4m3 bytes 0x00
        kv[1] = -0.0  # e4m3 0x80, RoPE bits 0x8000
        kv[2, :448] = 3.0  # all-equal blocks
        for b in range(7):  # amax = 448·2^k, k = b − 3, with ±448 after scaling
            kv[3, 64 * b + 5] = 448 * 2.0 ** (b - 3) * (-1) ** b
    return kv.to(DEVICE)


def shuffled_slots(n_pages: int, B: int, T: int, seed: int) -> torch.Tensor:
    """T distinct slots through a shuffled block table, with some −1 padding entries."""
    g = generator(seed)
    table = torch.randperm(n_pages, generator=g)
    logical = torch.randperm(n_pages * B, generator=g)[:T]
    slots = table[logical // B] * B + logical % B
    slots[torch.randperm(T, generator=g)[: max(1, T // 6)]] = -1
    return slots.to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# page geometry
# ----------------------------------------------------------------------------------------------------


def test_page_bytes_and_allocate():
    # docs/formats.md#the-584-byte-kv-cache-page: round_up(584·B, 576)
    assert [kc.page_bytes(b) for b in (1, 2, 16, 61, 64, 128, 256)] == [1152, 1728, 9792, 35712, 37440, 74880, 149760]
    c = kc.allocate(3, 61)
    assert c.dtype == torch.uint8 and tuple(c.shape) == (3, 35712) and c.device.type == DEVICE.type
    assert int(c.sum()) == 0
    with pytest.raises(ValueError, match="block_size"):
        kc.page_bytes(0)


# ----------------------------------------------------------------------------------------------------
# insert (writer)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
# T = 9: three tiles of the default 4 tokens per program, the last one partial
@pytest.mark.parametrize("B,pages,T", [(1, 40, 9), (2, 16, 9), (16, 3, 9), (61, 2, 9), (64, 2, 9), (256, 1, 9)])
def test_insert_bytes_exact_and_nothing_else_touched(backend, B, pages, T):
    kv = kv_rows(T, seed=B)
    slots = shuffled_slots(pages, B, T, seed=B + 1)
    cache = random_cache(pages, B, seed=B + 2)
    before = cache.clone()
    want, touched = expected_cache(before, kv, slots, B)
    kc.insert(cache, kv, slots, block_size=B, backend=backend)
    got = cache.cpu()
    assert_close(got, want, "exact", "cache bytes")
    # docs/kv_cache.md#pitfalls (#11): every byte outside the written records (other slots, −1 rows, page padding)
    # is untouched
    assert torch.equal(got[~touched], before.cpu()[~touched])
    assert int(touched.sum()) == 584 * int((slots >= 0).sum())


@pytest.mark.parametrize("B", [2, 64])
def test_triton_writer_equals_reference_writer(B):
    kv = kv_rows(9, seed=40 + B)
    slots = shuffled_slots(2 if B == 64 else 9, B, 9, seed=41)
    a, b = random_cache(slots.numel(), B, seed=3), None
    b = a.clone()
    kc.insert(a, kv, slots, block_size=B, backend="reference")
    kc.insert(b, kv, slots, block_size=B, backend="triton")
    assert_close(b, a, "exact", "cache bytes")


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_slots_and_padding_rows(backend):
    """Pitfall #11: slots may be shorter than kv (rows past it are padding) and holds −1."""
    B, pages = 16, 2
    kv = kv_rows(12, seed=5)
    slots = torch.tensor([3, -1, 17, 31, -1, 0, 16], device=DEVICE)  # 7 of 12 rows; includes slot 0
    cache = random_cache(pages, B, seed=6)
    before = cache.clone()
    want, touched = expected_cache(before, kv, slots, B)
    kc.insert(cache, kv, slots, block_size=B, backend=backend)
    assert_close(cache, want.to(DEVICE), "exact")
    assert int(touched.sum()) == 5 * 584
    # all −1: nothing at all is written (page 0 / slot 0 is the usual victim)
    kc.insert(cache, kv, torch.full((12,), -1, device=DEVICE), block_size=B, backend=backend)
    kc.insert(cache, kv, torch.zeros(0, dtype=torch.int64, device=DEVICE), block_size=B, backend=backend)
    assert_close(cache, want.to(DEVICE), "exact")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_slots(backend):
    kv = kv_rows(6, seed=9)
    s64 = torch.tensor([5, -1, 0, 7, 2, 1], device=DEVICE)
    a, b = random_cache(4, 2, seed=1), None
    b = a.clone()
    kc.insert(a, kv, s64, block_size=2, backend=backend)
    kc.insert(b, kv, s64.int(), block_size=2, backend=backend)
    assert_close(b, a, "exact")


def test_insert_into_strided_cache_view():
    """Kernels take the page stride from cache.stride(0): a cache that is every other page of a
    bigger buffer must be written at page·stride, not at page·page_bytes (pitfall #9)."""
    B = 2
    big = random_cache(8, B, seed=12)
    view = big[1::2]  # 4 pages, stride 2·1728
    before = big.clone()
    kv = kv_rows(5, seed=13)
    slots = torch.tensor([7, 0, -1, 4, 3], device=DEVICE)
    kc.insert(view, kv, slots, block_size=B)
    want_view, _ = expected_cache(before[1::2].contiguous(), kv, slots, B)
    assert_close(big[1::2], want_view.to(DEVICE), "exact")
    assert torch.equal(big[0::2].cpu(), before[0::2].cpu())  # the pages in between are untouched
    assert_close(kc.gather(view, slots, block_size=B), kc.gather(view, slots, block_size=B, backend="reference"), "exact")


def test_odd_page_stride_view():
    """Pages that start at odd byte addresses (stride 1729, storage offset 1). Writers refuse them with a
    clear error (the compiled insert wrote wrong NoPE bytes into such a view on the H200, 2026-11-30,
    cause not found; allocate() never makes one). Readers accept them: the kernel falls back to byte
    copies of the RoPE words and must give the reference's bytes."""
    B, n = 2, 5
    buf = torch.randint(0, 256, (1 + n * 1729,), generator=generator(14), dtype=torch.uint8).to(DEVICE)
    kv = kv_rows(6, seed=15)
    slots = torch.tensor([9, 2, -1, 0, 5, 6], device=DEVICE)
    for stride, offset in [(1729, 1), (1729, 0), (1728, 1)]:
        view = buf.as_strided((n, kc.page_bytes(B)), (stride, 1), offset)
        for backend in BACKENDS:
            with pytest.raises(ValueError, match="cache: pages must start at even byte addresses"):
                kc.insert(view, kv, slots, block_size=B, backend=backend)
    even = kc.allocate(n, B)
    kc.insert(even, kv, slots, block_size=B)
    view = buf.as_strided((n, kc.page_bytes(B)), (1729, 1), 1)
    view.copy_(even)
    want = kc.gather(even, slots, block_size=B, backend="reference")
    assert_close(kc.gather(view, slots, block_size=B, backend="reference"), want, "exact")
    assert_close(kc.gather(view, slots, block_size=B), want, "exact")


# ----------------------------------------------------------------------------------------------------
# gather (reader) and the round trip
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,pages,T", [(1, 30, 20), (2, 12, 20), (16, 2, 20), (61, 2, 20), (64, 1, 20), (256, 1, 12)])
def test_gather_of_insert_is_exact_dequant(backend, B, pages, T):
    kv = kv_rows(T, seed=100 + B)
    slots = shuffled_slots(pages, B, T, seed=101 + B)
    cache = random_cache(pages, B, seed=102)
    # written by the reference: the Triton writer's bytes are held to the same records by
    # test_insert_bytes_exact_and_nothing_else_touched, so this test is about the reader
    kc.insert(cache, kv, slots, block_size=B, backend="reference")
    read = torch.cat([slots.flip(0), torch.tensor([-1], device=DEVICE)])  # another order, another −1
    out = poison((read.numel(), 512), torch.bfloat16)
    got = kc.gather(cache, read, block_size=B, out=out, backend=backend)
    assert got.data_ptr() == out.data_ptr()
    src = torch.cat([kv.flip(0), torch.zeros(1, 512, dtype=torch.bfloat16, device=DEVICE)])
    q, s = quantize_ue8m0(src[:, :448], backend="reference")
    want = torch.cat([dequantize_ue8m0(q, s, backend="reference"), src[:, 448:]], dim=1)
    want[read < 0] = 0.0  # −1 slots read as zero rows
    assert_close(got, want, "exact", "gather(insert(kv))")  # exact (docs/kv_cache.md#math)
    # and it is the input, within the round-trip bound of docs/formats.md (RoPE dims bit-exact)
    ok = read >= 0
    x, xh = src[ok].double().cpu(), got[ok].double().cpu()
    e = (s[ok].double().cpu() - 127).repeat_interleave(64, dim=1)
    bound = torch.maximum(x[:, :448].abs() * 2.0**-4, torch.exp2(e - 10))
    assert bool(((xh[:, :448] - x[:, :448]).abs() <= bound).all())
    assert torch.equal(xh[:, 448:], x[:, 448:])


def test_gather_minus_one_rows_are_zero_and_other_rows_untouched_by_them():
    B = 2
    cache = random_cache(3, B, seed=21)  # random bytes everywhere, even under slot 0
    kc.insert(cache, kv_rows(1, seed=22), torch.tensor([4], device=DEVICE), block_size=B)
    slots = torch.tensor([-1, 4, -1, -1], dtype=torch.int32, device=DEVICE)
    out = poison((4, 512), torch.bfloat16)
    kc.gather(cache, slots, block_size=B, out=out)
    o = out.cpu()
    assert bool((o[[0, 2, 3]].view(torch.int16) == 0).all())  # +0.0 bits, not −0, not NaN poison
    assert not bool(torch.isnan(o[1].float()).any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_page_B2(backend):
    """The B = 2 page of docs/formats.md, built byte by byte. page_stride 1728; token 0 data 0..575, token 1 data
    576..1151; token 0 scales 1152..1159, token 1 scales 1160..1167; padding 1168..1727."""
    B, P = 2, 1728
    page = torch.full((2, P), 0xAB, dtype=torch.uint8)  # page 0 is a decoy, page 1 is the golden page
    g = page[1]
    # token 0: every NoPE byte 0x38 (= 1.0); block b has scale byte 120 + b  -> value 2^(b − 7)
    g[0:448] = 0x38
    # token 1: NoPE byte i = 0x40 + (i % 8)  (2.0, 2.25, ... 3.75), all blocks scale 130  -> × 8
    g[576 : 576 + 448] = 0x40 + (torch.arange(448) % 8)
    # RoPE dims 448 + j: token 0 holds bf16 j (bits of float j), token 1 holds −j; little-endian
    r0 = torch.arange(64, dtype=torch.float32).to(torch.bfloat16)
    g[448:576] = r0.view(torch.uint8)
    g[576 + 448 : 1152] = (-r0).view(torch.uint8)
    g[1152:1160] = torch.tensor([120, 121, 122, 123, 124, 125, 126, 0], dtype=torch.uint8)
    g[1160:1168] = torch.tensor([130] * 7 + [0], dtype=torch.uint8)
    cache = page.to(DEVICE)
    got = kc.gather(cache, torch.tensor([2, 3, -1], device=DEVICE), block_size=B, backend=backend).cpu().float()
    want0 = torch.cat([torch.exp2(torch.arange(7.0) - 7).repeat_interleave(64), torch.arange(64.0)])
    want1 = torch.cat([(2 + (torch.arange(448) % 8) / 4) * 8, -torch.arange(64.0)])
    assert torch.equal(got[0], want0)
    assert torch.equal(got[1], want1)
    assert torch.equal(got[2], torch.zeros(512))


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_page_B2_writer(backend):
    """The writer puts hand-predictable rows at exactly the golden offsets: all-(±448·2^k) blocks give
    e4m3 0x7E/0xFE and scale byte 127 + k."""
    B = 2
    kv = torch.zeros(2, 512)
    for b in range(7):
        kv[0, 64 * b : 64 * b + 64] = 448 * 2.0 ** (b - 3)  # token 0: bytes 0x7E, scales 124..130
        kv[1, 64 * b : 64 * b + 64] = -448 * 2.0 ** (-b)  # token 1: bytes 0xFE, scales 127..121
    kv[0, 448:] = 1.5  # bf16 0x3FC0 -> bytes C0 3F
    kv[1, 448:] = -2.0  # bf16 0xC000 -> bytes 00 C0
    cache = torch.full((2, 1728), 0xAB, dtype=torch.uint8, device=DEVICE)
    kc.insert(cache, kv.to(torch.bfloat16).to(DEVICE), torch.tensor([3, 2], device=DEVICE), block_size=B, backend=backend)
    p0, p1 = cache.cpu()
    assert bool((p0 == 0xAB).all())  # page 0 untouched
    assert bool((p1[0:448] == 0xFE).all()) and bool((p1[576:1024] == 0x7E).all())  # slot 2 = token 0 = kv row 1
    assert p1[448:576].tolist() == [0x00, 0xC0] * 64 and p1[1024:1152].tolist() == [0xC0, 0x3F] * 64
    assert p1[1152:1160].tolist() == [127, 126, 125, 124, 123, 122, 121, 0]
    assert p1[1160:1168].tolist() == [124, 125, 126, 127, 128, 129, 130, 0]
    assert bool((p1[1168:] == 0xAB).all())  # padding untouched


# -- wrong readers the layout tests must reject (pitfalls #8, #9) ------------------------------------


def _aos_reader(cache, slots, B, rec=584, stride=None):
    """A WRONG reader: token t's record as `rec` contiguous bytes at page·stride + rec·t (448 e4m3 |
    128 RoPE | 7 scales), the array-of-structures picture. rec=512 or 576 are the V3.2/BF16 habits."""
    flat = cache.cpu().reshape(-1)
    stride = stride or cache.stride(0)
    rows = []
    for slot in slots.tolist():
        page, t = divmod(slot, B)
        r = flat[page * stride + rec * t :][:584]
        q, rope, s = r[:448], r[448:576], r[576:583]
        nope = q.view(torch.float8_e4m3fn).float().reshape(7, 64) * torch.exp2(s.double() - 127).float()[:, None]
        rows.append(torch.cat([nope.flatten().to(torch.bfloat16), rope.clone().view(torch.bfloat16)]))
    return torch.stack(rows)


def _soa_reader(cache, slots, B, stride):
    """Our layout but with a computed page stride (B·584) instead of the tensor's."""
    flat = cache.cpu().reshape(-1)
    rows = []
    for slot in slots.tolist():
        page, t = divmod(slot, B)
        d, s = flat[page * stride + 576 * t :][:576], flat[page * stride + 576 * B + 8 * t :][:7]
        nope = d[:448].view(torch.float8_e4m3fn).float().reshape(7, 64) * torch.exp2(s.double() - 127).float()[:, None]
        rows.append(torch.cat([nope.flatten().to(torch.bfloat16), d[448:].clone().view(torch.bfloat16)]))
    return torch.stack(rows)


def test_wrong_layout_readers_fail():
    """Write two pages with the library, then read them back: our gather matches; readers using a
    per-token 584/576/512-byte record, or a B·584 page stride, do not (they would pass a test that only
    looks at page 0, token 0; these slots avoid it)."""
    B = 2
    kv = kv_rows(4, seed=77)[[3, 2]].repeat(2, 1)  # non-unit, per-block-different scales
    kv[:, 448:] = randn((4, 64), seed=78, device="cpu").to(DEVICE)
    cache = kc.allocate(3, B)
    slots = torch.tensor([1, 2, 3, 5], device=DEVICE)
    kc.insert(cache, kv, slots, block_size=B)
    ours = kc.gather(cache, slots, block_size=B).cpu()
    want = kc.gather(cache, slots, block_size=B, backend="reference").cpu()
    assert_close(ours, want, "exact")
    assert torch.equal(_soa_reader(cache, slots.cpu(), B, cache.stride(0)), want)  # the test reader is right

    def wrong_rows(r):
        return (r.float().nan_to_num(0.0) != want.float()).any(dim=1).tolist()

    for rec in (584, 576, 512):  # a per-token record: every token but page 0 / token 0 is garbage
        assert wrong_rows(_aos_reader(cache, slots.cpu(), B, rec=rec)) == [True] * 4
    # a computed B·584 page stride: page 0 reads fine, everything from page 1 on is misaligned
    assert wrong_rows(_soa_reader(cache, slots.cpu(), B, stride=B * 584)) == [False, True, True, True]


# ----------------------------------------------------------------------------------------------------
# int64 addressing (pitfall #10)
# ----------------------------------------------------------------------------------------------------


def test_reference_offsets_past_2_pow_31_on_meta():
    cache = torch.empty((60_000, kc.page_bytes(64)), dtype=torch.uint8, device="meta")
    slots = torch.tensor([59_999 * 64 + 63, 57_360 * 64])
    data, scales = kc.token_offsets(cache, slots, 64)
    assert data.dtype == torch.int64
    assert data.tolist() == [59_999 * 37_440 + 63 * 576, 57_360 * 37_440]
    assert scales.tolist() == [59_999 * 37_440 + 64 * 576 + 63 * 8, 57_360 * 37_440 + 64 * 576]
    assert min(data.tolist()) > 2**31


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_past_2_pow_31_strided_view(backend):
    """A cache whose page stride is 1 MiB: page 2100 starts past 2^31 bytes. The buffer is allocated
    with torch.empty, so the OS maps only the pages we touch (~2.2 GB virtual, a few MB resident)."""
    B, n, stride = 2, 2100, 1 << 20
    buf = torch.empty((n - 1) * stride + kc.page_bytes(B), dtype=torch.uint8, device=DEVICE)
    cache = buf.as_strided((n, kc.page_bytes(B)), (stride, 1))
    last = (n - 1) * B + 1
    slots = torch.tensor([last, 3, -1, last - 1], device=DEVICE)
    assert (n - 1) * stride > 2**31
    for p in (1, n - 1):
        cache[p].fill_(0xAB)
    kv = kv_rows(4, seed=31)
    kc.insert(cache, kv, slots, block_size=B, backend=backend)
    small = torch.full((2, kc.page_bytes(B)), 0xAB, dtype=torch.uint8, device=DEVICE)
    kc.insert(small, kv, torch.tensor([1, 3, -1, 0], device=DEVICE), block_size=B, backend="reference")
    # the last page holds rows 3 (offset 0) and 0 (offset 1), like page 0 of `small`; page 1 holds row 1
    assert_close(cache[n - 1], small[0], "exact", "last page")
    assert_close(cache[1], small[1], "exact", "page 1")
    got = kc.gather(cache, slots, block_size=B, backend=backend)
    want = kc.gather(small, torch.tensor([1, 3, -1, 0], device=DEVICE), block_size=B, backend="reference")
    assert_close(got, want, "exact")


@pytest.mark.skipif(interpreting(), reason="GPU only: a real 2.2 GB cache (docs/kv_cache.md#pitfalls, #10)")
def test_int64_offsets_real_58k_pages():
    """Pitfall #10: >= 58 000 pages of 37 440 B (~2.2 GB); write and read the last page."""
    B, n = 64, 58_600
    cache = kc.allocate(n, B)
    assert cache.numel() > 2**31
    kv = kv_rows(40, seed=58)
    last = n - 1
    slots = torch.cat([torch.arange(last * B + 40 - 32, last * B + 40), torch.arange(8)]).to(DEVICE)  # last page + page 0
    slots[5] = -1
    kc.insert(cache, kv, slots, block_size=B)
    small = kc.allocate(2, B)
    kc.insert(small, kv, torch.where(slots >= last * B, slots - (last - 1) * B, slots), block_size=B, backend="reference")
    assert_close(cache[last], small[1], "exact", "last page")
    assert_close(cache[0], small[0], "exact", "page 0")
    assert int(cache[1:last].count_nonzero()) == 0  # int32 wrap-around would have landed in here
    got = kc.gather(cache, slots, block_size=B)
    assert_close(got, kc.gather(cache, slots, block_size=B, backend="reference"), "exact")


# ----------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------


def test_insert_rejects_bad_input():
    B = 2
    cache = kc.allocate(2, B)
    kv = kv_rows(4, seed=1)
    s = torch.tensor([0, 1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match=r"slots: entry 2 = 4 is out of range; expected \[0, 4\) or -1"):
        kc.insert(cache, kv, torch.tensor([0, 1, 4], device=DEVICE), block_size=B)
    with pytest.raises(ValueError, match="slots: entry 1 = -2"):
        kc.insert(cache, kv, torch.tensor([0, -2], device=DEVICE), block_size=B)
    with pytest.raises(ValueError, match="slots: has 5 entries but kv only 4 rows"):
        kc.insert(cache, kv, torch.tensor([0, 1, 2, 3, -1], device=DEVICE), block_size=B)
    with pytest.raises(TypeError, match="slots: expected dtype"):
        kc.insert(cache, kv, s.float(), block_size=B)
    with pytest.raises(ValueError, match="slots: expected a 1-d tensor"):
        kc.insert(cache, kv, s[None], block_size=B)
    with pytest.raises(TypeError, match="kv: expected dtype torch.bfloat16"):
        kc.insert(cache, kv.float(), s, block_size=B)
    with pytest.raises(ValueError, match=r"kv: expected \[T, 512\]"):
        kc.insert(cache, kv[:, :448], s, block_size=B)
    with pytest.raises(ValueError, match="kv: expected a 2-d tensor"):
        kc.insert(cache, kv[None], s, block_size=B)
    with pytest.raises(TypeError, match="cache: expected dtype torch.uint8"):
        kc.insert(cache.view(torch.int8), kv, s, block_size=B)
    with pytest.raises(ValueError, match="cache: pages of 1728 bytes cannot hold block_size=3"):
        kc.insert(cache, kv, s, block_size=3)
    with pytest.raises(ValueError, match="cache: expected a 2-d tensor"):
        kc.insert(cache.reshape(-1), kv, s, block_size=B)
    with pytest.raises(ValueError, match="cache: each page must be contiguous"):
        kc.insert(torch.zeros(2, 2 * 1728, dtype=torch.uint8, device=DEVICE)[:, ::2], kv, s, block_size=B)
    with pytest.raises(ValueError, match="backend"):
        kc.insert(cache, kv, s, block_size=B, backend="cuda")


def test_gather_rejects_bad_input():
    B = 2
    cache = kc.allocate(2, B)
    with pytest.raises(ValueError, match=r"slots: entry 1 = 4 is out of range"):
        kc.gather(cache, torch.tensor([0, 4], device=DEVICE), block_size=B)
    with pytest.raises(ValueError, match="slots: entry 0 = -3"):
        kc.gather(cache, torch.tensor([-3], device=DEVICE), block_size=B)
    with pytest.raises(TypeError, match="slots: expected dtype"):
        kc.gather(cache, torch.tensor([0.0], device=DEVICE), block_size=B)
    with pytest.raises(ValueError, match="out: expected shape"):
        kc.gather(
            cache, torch.tensor([0, 1], device=DEVICE), block_size=B, out=torch.empty(3, 512, dtype=torch.bfloat16, device=DEVICE)
        )
    with pytest.raises(TypeError, match="out: expected dtype"):
        kc.gather(cache, torch.tensor([0], device=DEVICE), block_size=B, out=torch.empty(1, 512, device=DEVICE))
    with pytest.raises(ValueError, match="cache: pages of"):
        kc.gather(cache, torch.tensor([0], device=DEVICE), block_size=4)


# ----------------------------------------------------------------------------------------------------
# the torch.library custom ops
# ----------------------------------------------------------------------------------------------------


def test_custom_ops_opcheck():
    B = 2
    cache = random_cache(2, B, seed=90)
    kv = kv_rows(3, seed=91)
    slots = torch.tensor([2, -1, 1], device=DEVICE)
    kc.insert(cache, kv, slots, block_size=B)  # gather then reads valid records (no inf/NaN warnings)
    ins, gat = kc.default_launch("insert").op_args(), kc.default_launch("gather").op_args()
    torch.library.opcheck(
        torch.ops.dsv4ref.kv_insert.default, (cache, kv, slots, B, *ins), test_utils=("test_schema", "test_faketensor")
    )
    out = torch.empty(3, 512, dtype=torch.bfloat16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.dsv4ref.kv_gather.default, (cache, slots, out, B, *gat), test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("tok", [1, 4])
def test_tokens_per_program_launch_shapes(tok):
    """The kernels handle TOK tokens per program (a tuning knob, benchmarks/kv_cache.md); a last program
    with fewer than TOK real rows must not write or read past the end."""
    B = 16
    kv = kv_rows(11, seed=60)
    slots = shuffled_slots(2, B, 10, seed=61)  # 10 of 11 rows, 10 = 2·4 + 2
    a = random_cache(2, B, seed=62)
    b = a.clone()
    kc.insert(a, kv, slots, block_size=B, launch=kc.KVCacheLaunch(tokens_per_program=tok))
    kc.insert(b, kv, slots, block_size=B, backend="reference")
    assert_close(a, b, "exact")
    out = poison((10, 512), torch.bfloat16)
    kc.gather(a, slots, block_size=B, out=out, launch=kc.KVCacheLaunch(tokens_per_program=tok))
    assert_close(out, kc.gather(a, slots, block_size=B, backend="reference"), "exact")


@pytest.mark.parametrize(
    "launch",
    [
        kc.KVCacheLaunch(4, native_casts=True, evict_first=True, streaming_stores=True),
        kc.KVCacheLaunch(4, native_casts=True, early_loads=True),
        kc.KVCacheLaunch(2, native_casts=True, streaming_stores=True, early_loads=True, max_registers=80),
    ],
    ids=["native+hints", "early", "early-2-cs-maxreg"],
)
def test_launch_variants_same_bytes(launch):
    """Every KVCacheLaunch field is a launch choice only: the bytes are the reference's (benchmarks/kv_cache.md).
    Interpreted, native_casts falls back to the integer encoders; a GPU run checks the casts."""
    B = 16
    kv = kv_rows(11, seed=63)
    slots = shuffled_slots(2, B, 10, seed=64)
    a = random_cache(2, B, seed=65)
    b = a.clone()
    kc.insert(a, kv, slots, block_size=B, launch=launch)
    kc.insert(b, kv, slots, block_size=B, backend="reference")
    assert_close(a, b, "exact")
    out = poison((10, 512), torch.bfloat16)
    kc.gather(a, slots, block_size=B, out=out, launch=launch)
    assert_close(out, kc.gather(a, slots, block_size=B, backend="reference"), "exact")


@pytest.mark.parametrize(
    "launch",
    [
        PersistentLaunch(kc.KVCacheLaunch(2)),  # on the CPU one program loops over every tile
        PersistentLaunch(kc.KVCacheLaunch(4, 2), pipeline_stages=2),
        PersistentLaunch(kc.KVCacheLaunch(8, early_loads=True)),
    ],
    ids=["persistent", "persistent-pipelined", "early-persistent"],
)
def test_persistent_variants_same_bytes(launch):
    """The persistent grids of dsv4ref.kv_cache.variants (no default) write and read the reference's bytes."""
    B = 16
    kv = kv_rows(11, seed=63)
    slots = shuffled_slots(2, B, 10, seed=64)
    a = random_cache(2, B, seed=65)
    b = a.clone()
    persistent.launch_insert(a, kv, slots, B, launch)
    kc.insert(b, kv, slots, block_size=B, backend="reference")
    assert_close(a, b, "exact")
    out = poison((10, 512), torch.bfloat16)
    persistent.launch_gather(a, slots, out, B, launch)
    assert_close(out, kc.gather(a, slots, block_size=B, backend="reference"), "exact")


@pytest.mark.parametrize(
    "launch",
    [
        kc.KVCacheLaunch(4, native_casts=True, early_loads=True),
        kc.KVCacheLaunch(2, early_loads=True, streaming_stores=True, max_registers=64),
        kc.KVCacheLaunch(8, 2, early_loads=True),
    ],
    ids=["4x1", "2x1-cs-maxreg", "8x2"],
)
def test_early_loads_read_minus_one_rows_but_never_write_them(launch):
    """``early_loads`` reads a tile's kv rows before its slots arrive, so it reads the rows of slot −1 too: they
    must still write nothing (page 0 / slot 0, where a clamped −1 would land, is in the cache), and their NaN /
    ±inf values, which send the whole tile down the non-finite path, must not change the other rows' bytes. Rows
    past len(slots) are never read (here they are NaN too)."""
    B, pages, T = 16, 3, 24
    kv = kv_rows(T + 5, seed=70)
    slots = shuffled_slots(pages, B, T, seed=71)
    first = int((slots < 0).nonzero()[0])
    slots[0], slots[first] = -1, slots[0].clone()  # tile 0 (every TOK) holds a −1 row
    slots[slots == 0] = -1  # slot 0 stays unwritten: where a −1 row would land if its slot were clamped, not masked
    minus = (slots < 0).nonzero().flatten().tolist()
    assert len(minus) >= 3 and minus[0] == 0
    bits = kv.view(torch.int16)
    bits[minus[0]] = 0x7FC0  # a NaN row
    bits[minus[1], 5] = 0x7F80  # one +inf in block 0
    bits[minus[2], 447] = -128  # 0xFF80: -inf in block 6
    bits[T:] = 0x7FC0  # padding rows past len(slots)
    cache = random_cache(pages, B, seed=72)
    before = cache.clone()
    want, touched = expected_cache(before, kv, slots, B)
    kc.insert(cache, kv, slots, block_size=B, launch=launch)
    assert_close(cache, want.to(DEVICE), "exact")
    assert torch.equal(cache[~touched.to(DEVICE)], before[~touched.to(DEVICE)])
    assert not bool(touched[0, :576].any())  # slot 0's bytes were checked unchanged just above


def test_launch_fields_are_checked():
    with pytest.raises(TypeError, match="native_casts: expected a bool"):
        kc.KVCacheLaunch(4, native_casts=1)
    with pytest.raises(TypeError, match="early_loads: expected a bool"):
        kc.KVCacheLaunch(4, early_loads=1)
    with pytest.raises(ValueError, match="max_registers"):
        kc.KVCacheLaunch(4, max_registers=8)
    with pytest.raises(ValueError, match="programs_per_sm"):
        PersistentLaunch(kc.KVCacheLaunch(4), programs_per_sm=0)
    with pytest.raises(ValueError, match="pipeline_stages"):
        PersistentLaunch(kc.KVCacheLaunch(4), pipeline_stages=9)
    assert kc.KVCacheLaunch(8).op_args() == (8, 1, False, False, False, False, 0)


def test_default_launch_is_what_its_docstring_says_and_changes_no_byte():
    """default_launch(op): the measured GPU defaults (insert 4 tokens x 2 warps, gather 4 x 1, both with the
    hardware casts); INTERPRETER_TOKENS tokens per program in the interpreter; with no argument, this process's.
    The GPU's tiles and the interpreter's give the same bytes on a step of 70 tokens (partial tiles of both)."""
    from dsv4ref.kv_cache.launch import INTERPRETER_TOKENS

    for op, (tok, warps) in (("insert", (4, 2)), ("gather", (4, 1))):
        gpu, cpu = kc.default_launch(op, interpreted=False), kc.default_launch(op, interpreted=True)
        assert (gpu.tokens_per_program, gpu.num_warps, gpu.native_casts) == (tok, warps, True)
        assert cpu.tokens_per_program == INTERPRETER_TOKENS
        assert kc.default_launch(op) == (cpu if interpreting() else gpu)
    B = 16
    kv, slots = kv_rows(70, seed=92), torch.randperm(6 * B, generator=generator(93))[:70].to(DEVICE)
    caches = []
    for interpreted in (False, True):
        cache = random_cache(6, B, seed=94)
        kc.insert(cache, kv, slots, block_size=B, launch=kc.default_launch("insert", interpreted=interpreted))
        out = kc.gather(cache, slots, block_size=B, launch=kc.default_launch("gather", interpreted=interpreted))
        caches.append((cache, out.view(torch.int16)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
