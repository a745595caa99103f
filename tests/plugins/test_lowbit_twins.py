"""The torch backend's low-bit state codec (``mixprec_torch.lowbit.codec``: ``quantize`` and
``dequantize``, which run the C kernels on the CPU where they are in use, and their torch
twins ``quantize_torch`` and ``dequantize_torch``) gives the NumPy reference's codes, block
absmax and decoded values bit for bit (``mixprec_numpy.lowbit``): every format and sign, odd
lengths and short last blocks, zero blocks, exact ties on the midpoints, subnormal and huge
values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mixprec_numpy")

from mixprec.kit import LOWBIT_FORMATS, StateFormat, parse_state_format, state_map  # noqa: E402
from mixprec_numpy import lowbit as reference  # noqa: E402
from mixprec_torch.lowbit import codec as twin  # noqa: E402

F32 = np.float32


def _fmt(text: str) -> StateFormat:
    fmt = parse_state_format(text)
    assert fmt is not None
    return fmt


def _data(fmt: StateFormat, signed: bool) -> dict[str, np.ndarray]:
    """Named float32 arrays; lengths chosen to leave short last blocks and odd counts."""
    rng = np.random.default_rng(35)
    decades = 10.0 ** rng.integers(-12, 4, 1001)
    mids = np.array(state_map(fmt.name, signed).mids, F32)
    ties = []
    for scale in (F32(1.0), F32(2.0**-30), F32(2.0**60), F32(0.75), F32(3.0)):
        for start in range(0, mids.size, fmt.block - 1):  # absmax first, then the midpoints
            chunk = mids[start : start + fmt.block - 1] * scale
            ties += [F32(scale), *chunk, *[F32(0.0)] * (fmt.block - 1 - chunk.size)]
    subnormal = np.array([1e-40, -1e-42, 5e-45, -3e-39, 0.0, 1.1e-38, 2.0**-126, -(2.0**-149)])
    return {
        "one": np.array([-0.3], F32),
        "odd": (rng.standard_normal(1001) * decades).astype(F32),
        "moment": np.square(rng.standard_normal(257) * decades[:257]).astype(F32),
        "zeros": np.concatenate([np.zeros(fmt.block), -np.zeros(5), [0.0, 1e-3, -0.0]]).astype(F32),
        "ties": np.array(ties, F32),
        "subnormal": np.tile(subnormal, 9).astype(F32),
        "subnormal_under_normal": np.tile([2.0**-126, 1e-39, -1e-41, 3e-40, 1e-45], 13).astype(F32),
        "large": np.tile([3.4e38, -3e38, 1e38, 1.0, -1e-30, 7e37, 2.0**127, -(2.0**100)], 7).astype(
            F32
        ),
    }


def _bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, F32).view(np.uint32).tobytes()


CASES = [
    (f"{name}(block={block})" if block else name, signed)
    for name in LOWBIT_FORMATS
    for block in (None, 32, 4096)
    for signed in (True, False)
]


#: (quantize, dequantize) of the backend: as wrap uses them, and the torch twins alone.
CODECS = {
    "codec": (twin.quantize, twin.dequantize),
    "torch-twin": (twin.quantize_torch, twin.dequantize_torch),
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(("state", "signed"), CASES, ids=[f"{s}-{g}" for s, g in CASES])
def test_the_torch_codec_is_the_numpy_reference_bit_for_bit(
    state: str, signed: bool, codec: str
) -> None:
    fmt = _fmt(state)
    quantize, dequantize = CODECS[codec]
    for name, x in _data(fmt, signed).items():
        want = reference.quantize(x, fmt, signed)
        codes, absmax = quantize(torch.from_numpy(x.copy()), fmt, signed)
        where = f"{state} {'signed' if signed else 'unsigned'} {name}"
        assert codes.dtype == torch.uint8, where
        assert codes.numpy().tobytes() == want.codes.tobytes(), f"codes differ: {where}"
        assert _bits(absmax.numpy()) == _bits(want.absmax), f"absmax differs: {where}"
        decoded = dequantize(codes, absmax, fmt, signed, x.size).numpy()
        wanted = reference.dequantize(want, fmt, signed, x.size)
        assert _bits(decoded) == _bits(wanted), f"decoded values differ: {where}"


@pytest.mark.parametrize("name", LOWBIT_FORMATS)
def test_the_twins_decode_each_others_codes(name: str) -> None:
    """Codes written by one load in the other: the same packing, the same maps."""
    fmt = _fmt(f"{name}(block=64)")
    x = np.random.default_rng(1).standard_normal(201).astype(F32)
    q = reference.quantize(x, fmt, True)
    decoded = twin.dequantize(torch.from_numpy(q.codes), torch.from_numpy(q.absmax), fmt, True, 201)
    assert _bits(decoded.numpy()) == _bits(reference.dequantize(q, fmt, True, 201))
