"""The codecs (commd/codecs/): round trips on every dtype each takes, special values, bounds, refusals.

References are independent of the code under test: torch's own float32 → bfloat16 / float16
conversions for the lossy codecs, the input's bytes for the lossless ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commd.codecs import CODECS, Codec, CodecError, by_wire_id, get, names

SIZES = (0, 1, 7, 1000, 100_003)  # not multiples of anything
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, 1.17549435e-38,
                    3.0e38, -3.0e38, 65504.0, 65520.0, 6.1e-5, 5.96e-8, 1.0, -1.0], np.float32)
#: NaNs whose payload a careless rounding carries into the exponent (→ inf) or the sign (→ -0.0).
ODD_NANS = np.array([0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF, 0x7FC0FFFF], np.uint32).view(np.float32)
SPECIAL = np.concatenate([SPECIAL, ODD_NANS])
LOSSY_REFERENCE = {"bf16": torch.bfloat16, "bf16-cast": torch.bfloat16, "fp16": torch.float16}


def data(dtype: str, size: int, seed: int = 0) -> np.ndarray:
    """Model-like values for floats (weights ~ N(0, 0.02), a tail of large ones, the special values),
    the whole range for integers, random bits for bool."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size).astype(bool)
    kind = np.dtype(dtype).kind
    if kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    values = rng.standard_normal(size) * 0.02
    values[::97] *= 1e4
    if kind == "c":
        values = values + 1j * rng.standard_normal(size)
    out = values.astype(dtype)
    if kind == "f":
        with np.errstate(invalid="ignore"):  # (signalling NaNs widen with a warning)
            special = SPECIAL.astype(dtype) if dtype != "float16" else SPECIAL[np.abs(SPECIAL) < 6e4].astype(dtype)
        n = min(size, special.size)
        out[:n] = special[:n]
    return out


def round_trip(codec: Codec, x: np.ndarray) -> tuple[np.ndarray, int]:
    out = np.full(codec.max_encoded(x.nbytes) + 16, 0xAB, np.uint8)
    n = codec.encode(x, out)
    assert 0 <= n <= codec.max_encoded(x.nbytes)
    assert (out[codec.max_encoded(x.nbytes):] == 0xAB).all(), "encode wrote past max_encoded"
    y = np.full_like(x, 3)
    codec.decode(out[:n], y)
    return y, n


def cases() -> list[tuple[str, str]]:
    return [(c.name, dtype) for c in CODECS for dtype in sorted(c.dtypes)]


@pytest.mark.parametrize(("name", "dtype"), cases())
def test_round_trip_on_every_dtype_and_size(name: str, dtype: str) -> None:
    codec = get(name)
    for size in SIZES:
        x = data(dtype, size)
        y, _ = round_trip(codec, x)
        if not codec.lossy:
            assert y.tobytes() == x.tobytes(), (name, dtype, size)  # NaN payloads, -0.0: every bit
            continue
        want = torch.from_numpy(x).to(LOSSY_REFERENCE[name]).to(torch.float32).numpy()
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(y), nan), (name, size)
        assert y[~nan].tobytes() == want[~nan].tobytes(), (name, size)  # torch's rounding, bit for bit
        assert (np.signbit(y[nan]) == np.signbit(x[nan])).all(), "a NaN lost its sign"


@pytest.mark.parametrize("name", [c.name for c in CODECS if c.lossy])
def test_lossy_codecs_keep_their_stated_bound_and_are_unbiased(name: str) -> None:
    codec = get(name)
    relative, absolute = codec.error_bound("float32")
    x = data("float32", 200_000, seed=5)
    finite = np.isfinite(x) & (np.abs(x) < (65504.0 if name == "fp16" else 3.39e38))
    y, _ = round_trip(codec, x)
    err = np.abs(y[finite].astype(np.float64) - x[finite])
    assert (err <= np.maximum(relative * np.abs(x[finite].astype(np.float64)), absolute)).all(), name
    normal = finite & (np.abs(x) > 1e-3)
    signed = (y[normal].astype(np.float64) - x[normal]) / np.abs(x[normal])
    assert abs(signed.mean()) < relative / 20, f"{name} is biased: mean relative error {signed.mean():.2e}"


@pytest.mark.parametrize("name", [c.name for c in CODECS if c.lossy])
def test_lossy_codecs_are_idempotent_and_round_in_place_gives_what_receivers_decode(name: str) -> None:
    codec = get(name)
    assert codec.idempotent
    x = data("float32", 10_007, seed=9)
    y, n = round_trip(codec, x)
    z, m = round_trip(codec, y)
    assert z.tobytes() == y.tobytes() and m == n
    rounded = x.copy()
    codec.round_in_place(rounded)
    assert rounded.tobytes() == y.tobytes()


def test_the_lossy_compressed_codec_compresses_model_like_data() -> None:
    x = data("float32", 1 << 18, seed=2)
    _, n_bf16 = round_trip(get("bf16"), x)
    _, n_cast = round_trip(get("bf16-cast"), x)
    assert n_cast == x.nbytes // 2
    assert n_bf16 < 0.45 * x.nbytes, n_bf16 / x.nbytes  # measured 0.38 on N(0, 0.02) weights


@pytest.mark.parametrize("name", names())
def test_bad_inputs_are_codec_errors_naming_what_is_wrong(name: str) -> None:
    codec = get(name)
    x = data("float32", 1000)
    out = np.empty(codec.max_encoded(x.nbytes), np.uint8)
    with pytest.raises(CodecError, match="output bytes"):
        codec.encode(x, out[:codec.max_encoded(x.nbytes) - 1])
    with pytest.raises(CodecError, match="contiguous"):
        codec.encode(np.zeros((10, 10), np.float32)[:, ::2], out)
    if "int32" not in codec.dtypes:
        with pytest.raises(CodecError, match=f"{name}.*int32"):
            codec.encode(np.zeros(10, np.int32), out)
    n = codec.encode(x, out)
    y = np.empty_like(x)
    with pytest.raises(CodecError):
        codec.decode(out[:n - 1], y)  # one byte short
    with pytest.raises(CodecError):
        codec.decode(out[:n], np.empty(999, np.float32))  # not this array's coding
    garbage = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    if codec.lossy and not name.startswith("bf16") or name in ("bf16-cast", "fp16"):
        return  # a plain cast has no structure: any bytes of the right length are some array
    with pytest.raises(CodecError):
        codec.decode(garbage, y)
    corrupt = out[:n].copy()
    corrupt[:16] ^= 0x5A  # the chunk header
    with pytest.raises(CodecError):
        codec.decode(corrupt, y)


def test_codecs_are_found_by_name_and_wire_id_and_unknown_ones_are_refused() -> None:
    assert {c.name: c.wire_id for c in CODECS} == {"bf16": 1, "bf16-cast": 2, "lossless": 3, "lossless-zstd": 4,
                                                    "fp16": 5}  # on the wire: never renumber
    for codec in CODECS:
        assert get(codec.name) is codec and by_wire_id(codec.wire_id) is codec
    with pytest.raises(CodecError, match="unknown codec 'zip'.*bf16, bf16-cast, lossless"):
        get("zip")
    for bad in (0, 99, True, "1"):
        with pytest.raises(CodecError, match="no codec has wire id"):
            by_wire_id(bad)  # type: ignore[arg-type]
