"""The low-bit codec's search index (``mp_lowbit_index``, issue 35): the compact index keyed on
the clamped magnitude's exponent and a few mantissa bits answers as torch.searchsorted does,
bit for bit, at its edges.

The index keeps only the buckets a map spans: magnitudes below ``lo`` (the bucket under the
smallest midpoint) and above ``hi`` (the bucket over the largest) are clamped, NaN is made
``+hi``, a bucket holds at most one midpoint where the map allows it (else it takes the binary
search). So the values that matter are: every midpoint and its neighbours, the first and last
value of every bucket, ``lo`` and ``hi`` and their neighbours, the magnitudes below ``lo``
(subnormals, ±0) and above ``hi`` (beyond the map: infinities, huge values, NaN of either
sign, which a block whose absmax is NaN divides by 1), on every format's two maps, and maps
made here to crowd buckets, hold a zero midpoint or reach float32's largest value.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mixprec.kit import StateFormat, parse_state_format, state_map  # noqa: E402
from mixprec_torch.cpu import clib  # noqa: E402
from mixprec_torch.lowbit import codec  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(clib.library() is None, reason=f"native kernels: {clib.status()}"),
]

FORMATS = ["int8", "int4", "fp8"]
_HEAD = 4  # the index's header words: shift, lo, hi, nb
_NAN = float("nan")


def _fmt(text: str) -> StateFormat:
    parsed = parse_state_format(text)
    assert parsed is not None
    return parsed


def _floats(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of the given bit patterns (int64 in [0, 2**32))."""
    bits = bits.to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _header(index: torch.Tensor) -> tuple[int, int, int, int]:
    shift, lo, hi, nb = (int(w) & 0xFFFFFFFF for w in index[:_HEAD])
    return shift, lo, hi, nb


def _edges(mids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Normalised values at the index's edges (both signs): the midpoints and two ulps either
    side, every bucket's first and last magnitude, lo and hi and theirs, and magnitudes far
    below lo (subnormals, zeros) and above hi (up to inf)."""
    shift, lo, hi, _ = _header(index)
    mags = (mids.view(torch.int32).to(torch.int64) & 0x7FFFFFFF).unique()
    near = torch.cat([mags + d for d in (-2, -1, 0, 1, 2)])
    buckets = torch.arange(lo >> shift, (hi >> shift) + 2, dtype=torch.int64) << shift
    starts = torch.cat([buckets, buckets - 1, buckets + 1])
    limits = torch.tensor([lo - 2, lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, hi + 2])
    tiny = torch.tensor([0, 1, 2, 0x7FFFFF, 0x800000, 0x800001, 0x00400000])
    big = torch.tensor([0x3F800000, 0x3F800001, 0x40000000, 0x7F7FFFFF, 0x7F800000])
    found = torch.cat([near, starts, limits, tiny, big]).clamp(0, 0x7F800000).unique()
    values = _floats(found)
    values = values[values <= 1.0]  # at most 1 in n = x / absmax of a finite block
    return torch.cat([values, -values])


def _blocks(values: torch.Tensor, block: int, head: float) -> torch.Tensor:
    """``values`` in blocks of ``block`` elements each led by ``head`` (its block's absmax
    where |head| is the largest: 1.0 makes n = x; NaN makes the divisor 1)."""
    per = block - 1
    pad = (-values.numel()) % per
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per)
    heads = torch.full((values.shape[0], 1), head)
    return torch.cat([heads, values], dim=1).reshape(-1)


def _twin(x: torch.Tensor, mids: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """The twin's codes of x under the midpoints ``mids`` (codec.quantize_torch's scheme)."""
    n = x.numel()
    pad = (-n) % block
    blocks = torch.cat([x, torch.zeros(pad)]).view(-1, block)
    a = blocks.abs().amax(dim=1)
    divisor = torch.where(a > 0, a, torch.ones_like(a))
    codes = torch.searchsorted(mids, (blocks / divisor[:, None]).reshape(-1))[:n].to(torch.uint8)
    if bits == 4:
        if n % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes


def _native(x: torch.Tensor, table: clib.LowbitMap, block: int, bits: int) -> torch.Tensor:
    lib = clib.library()
    assert lib is not None
    n = x.numel()
    codes = torch.empty((n + 1) // 2 if bits == 4 else n, dtype=torch.uint8)
    absmax = torch.empty(-(-n // block), dtype=torch.float32)
    clib.lowbit_quantize(lib, x.contiguous(), block, table, codes, absmax)
    return codes


def _same(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    diff = (got != want).nonzero().reshape(-1)
    if diff.numel():
        first = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.numel()} codes differ; first at byte {first}: got {int(got[first])}, "
            f"want {int(want[first])} (x near {x[2 * first : 2 * first + 2].tolist()})"
        )


def _random(count: int, seed: int) -> torch.Tensor:
    """Random float32 bit patterns over the whole space (NaN, inf, subnormals included) and
    normal values over many decades."""
    g = torch.Generator().manual_seed(seed)
    bits = _floats(torch.randint(0, 2**32, (count,), generator=g, dtype=torch.int64))
    decades = torch.logspace(-12, 0, count)[torch.randperm(count, generator=g)]
    return torch.cat([bits, torch.randn(count, generator=g) * decades])


def _check(mids: torch.Tensor, index: torch.Tensor, table: clib.LowbitMap, bits: int) -> None:
    """Every edge value, in blocks of n = x (absmax 1), of n = x (absmax NaN: beyond the map,
    infinities and NaN of either sign) and of random absmax; random values in every block
    size's blocks."""
    edges = _edges(mids, index)
    beyond = torch.cat(
        [
            _floats(torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001])),
            torch.tensor([1.5, -1.5, 3e38, -3e38, 2.0**100, -(2.0**-100), 7.0, -7.0]),
            edges * 4.0,
        ]
    )
    g = torch.Generator().manual_seed(len(mids))
    cases = {  # what: (values, block)
        "edges, absmax 1": (
            _blocks(edges[torch.randperm(edges.numel(), generator=g)], 64, 1.0),
            64,
        ),
        "edges in order, absmax 1": (_blocks(edges, 256, 1.0), 256),
        "beyond the map, absmax NaN": (_blocks(beyond, 32, _NAN), 32),
        "edges, absmax NaN": (_blocks(edges, 128, _NAN), 128),
        "edges times a random absmax": (_blocks(edges * 3.7e-3, 64, 3.7e-3), 64),
    }
    for block in (32, 256, 4096):
        cases[f"random, block {block}"] = (_random(3 * block + 5, seed=block), block)
    for what, (x, block) in cases.items():
        got = _native(x, table, block, bits)
        _same(got, _twin(x, mids, block, bits), x, what)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_each_formats_index_answers_as_searchsorted_at_its_edges(name: str, signed: bool) -> None:
    fmt = _fmt(name)
    lib = clib.library()
    assert lib is not None
    tables = codec.tables(fmt, signed, torch.device("cpu"))
    table = tables.native(lib)
    index = clib.lowbit_index(lib, tables.mids)
    assert index.numel() * 4 <= 32 * 1024, "the index fits a core's L1"
    _check(tables.mids, index, table, fmt.bits)
    # and through the codec itself (the twin of record)
    edges = _blocks(_edges(tables.mids, index), fmt.block, 1.0)
    codes, _ = codec.quantize(edges, fmt, signed)
    twin, _ = codec.quantize_torch(edges, fmt, signed)
    _same(codes, twin, edges, f"{name} codec")


def _made(
    mids: list[float] | torch.Tensor, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, clib.LowbitMap, list[torch.Tensor]]:
    """A map of the given ascending midpoints (its values any, NaN-padded): the midpoints,
    their index, the struct, and the tensors the struct points into (keep them alive)."""
    lib = clib.library()
    assert lib is not None
    m = torch.as_tensor(mids, dtype=torch.float32).contiguous()
    assert bool((m[1:] > m[:-1]).all()) and m.numel() < 2**bits
    values = torch.full((1 << bits,), _NAN)
    values[: m.numel() + 1] = torch.linspace(-1, 1, m.numel() + 1)
    index = clib.lowbit_index(lib, m)
    table = clib.LowbitMap(values.data_ptr(), m.data_ptr(), index.data_ptr(), m.numel(), bits)
    return m, index, table, [m, values, index]  # the struct points into them


def _ulps(x: float, count: int) -> list[float]:
    t = torch.tensor([x], dtype=torch.float32)
    out = []
    for _ in range(count):
        out.append(float(t))
        t = torch.nextafter(t, torch.tensor([2.0]))
    return out


MADE = {
    # a bucket of many midpoints one ulp apart: the binary search
    "crowded": sorted({*_ulps(0.5, 40), *_ulps(-0.25, 3), 0.75, 0.01, -0.9, *_ulps(1e-3, 2)}),
    # a zero midpoint and subnormal ones: no clamp below, bucket 0 holds midpoints
    "zero and subnormals": [-1e-39, -1e-44, 0.0, 1e-45, 3e-42, 1e-38, 0.5],
    # the largest float32: hi's bucket starts at inf
    "up to the largest": [-3.4028235e38, -1.0, 0.5, 1e30, 3.4028235e38],
    # midpoints on bucket starts (powers of two), the smallest among them
    "on bucket starts": [-0.5, -(2.0**-20), 2.0**-20, 2.0**-10, 0.5],
    "one": [0.25],
    "two far apart": [1e-30, 1e30],
    "negative only": [-0.75, -0.5, -1e-6],
    "dense near 1": torch.linspace(0.9, 0.999, 200).unique().tolist(),
}


@pytest.mark.parametrize("name", list(MADE))
def test_made_maps_index_answers_as_searchsorted(name: str) -> None:
    for bits in (8, 4) if len(MADE[name]) < 16 else (8,):
        m, index, table, held = _made(MADE[name], bits)
        _check(m, index, table, bits)
        del held


def test_a_crowded_bucket_is_marked_for_the_binary_search() -> None:
    _, index, _, _ = _made(MADE["crowded"])
    entries = index[_HEAD:].to(torch.int64) & 0xFFFFFFFF
    assert bool(((entries & 0x100) != 0).any())
    for name in FORMATS:  # the formats' own maps crowd no bucket: one load and one compare
        for signed in (True, False):
            mids = torch.tensor(state_map(name, signed).mids, dtype=torch.float32)
            lib = clib.library()
            assert lib is not None
            found = clib.lowbit_index(lib, mids)[_HEAD:].to(torch.int64) & 0xFFFFFFFF
            assert not bool(((found & 0x100) != 0).any()), (name, signed)


def test_the_index_asks_for_its_size_first() -> None:
    lib = clib.library()
    assert lib is not None
    mids = torch.tensor(state_map("int8", True).mids, dtype=torch.float32)
    words = lib.mp_lowbit_index(mids.data_ptr(), mids.numel(), None, 0)
    short = torch.full((words,), -7, dtype=torch.int32)
    assert lib.mp_lowbit_index(mids.data_ptr(), mids.numel(), short.data_ptr(), words - 1) == words
    assert bool((short == -7).all()), "a buffer too small is left alone"
    assert torch.equal(clib.lowbit_index(lib, mids), clib.lowbit_index(lib, mids))
