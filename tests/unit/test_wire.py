"""afd.wire: round trips of every dtype and every validation error on the receiving side."""

import random
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from afd.messages import FFNReply, FFNRequest, Trace
from afd.quant import quantize_fp8
from afd.wire import (
    WIRE_ERROR_CODES,
    WireError,
    WireLimits,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

LIMITS = WireLimits(hidden_size=32, num_layers=4, num_experts=8, max_tokens=16, top_k=2)
REPO = Path(__file__).resolve().parents[2]


def _request(dtype=torch.float8_e4m3fn, t=5, k=2, layer=1, seed=0, **kw) -> FFNRequest:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, LIMITS.hidden_size, generator=g)  # [T, H]
    hidden, scales = quantize_fp8(x) if dtype == torch.float8_e4m3fn else (x.to(dtype), None)
    fields = dict(
        layer=layer,
        micro_batch=2,
        seq=41,
        hidden=hidden,
        scales=scales,
        expert_ids=torch.randint(0, LIMITS.num_experts, (t, k), generator=g),  # [T, k] int64
        expert_weights=torch.rand(t, k, generator=g),  # [T, k]
        sender="attn-0",
        deadline=time.time() + 30,
        t_send=123.5,
    )
    fields.update(kw)
    return FFNRequest(**fields)


def _wire(frames) -> list[bytes]:
    return [bytes(f) for f in frames]  # as a receiver gets them: fresh, immutable buffers


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [0, 2])
def test_request_round_trip(dtype, k):
    req = _request(dtype, k=k)
    got = decode_request(_wire(encode_request(req)), LIMITS)
    assert _same(got.hidden, req.hidden)
    assert (got.scales is None) == (dtype != torch.float8_e4m3fn)
    if got.scales is not None:
        assert torch.equal(got.scales, req.scales)
    assert got.expert_ids.dtype == torch.int32 and torch.equal(got.expert_ids, req.expert_ids.int())
    assert torch.equal(got.expert_weights, req.expert_weights)
    for name in ("layer", "micro_batch", "seq", "sender", "deadline", "t_send"):
        assert getattr(got, name) == getattr(req, name)


def test_zero_tokens_round_trip():
    got = decode_request(_wire(encode_request(_request(t=0))), LIMITS)
    assert got.hidden.shape == (0, LIMITS.hidden_size) and got.expert_ids.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reply_round_trip(dtype):
    trace = Trace(
        a_send=1.0, f_recv=2.0, f_compute_start=3.0, f_compute_end=4.0, f_send=5.0, merged=3
    )
    out = torch.randn(5, LIMITS.hidden_size).to(dtype)  # [T, H]
    reply = FFNReply(seq=9, layer=3, micro_batch=1, output=out, trace=trace)
    got = decode_reply(_wire(encode_reply(reply)), LIMITS)
    assert got.ok and _same(got.output, out)
    assert (got.seq, got.layer, got.micro_batch, got.trace) == (9, 3, 1, trace)


@pytest.mark.parametrize("code", ["bad_size", "internal", "deadline_exceeded", "overloaded"])
def test_error_reply_round_trip(code):
    reply = FFNReply(seq=4, layer=1, micro_batch=0, output=None, error_code=code, error="why")
    got = decode_reply(_wire(encode_reply(reply)))
    assert not got.ok and got.output is None
    assert (got.seq, got.error_code, got.error) == (4, code, "why")


def _header_edit(frames, **changes):
    """Re-encode a request header with some fields changed (a lying sender)."""
    from afd.v1 import ffn_pb2  # tests may look inside; the product goes through afd.wire

    header = ffn_pb2.FFNRequestHeader.FromString(frames[0])
    for name, value in changes.items():
        setattr(header, name, value)
    return [header.SerializeToString(), *frames[1:]]


def _expect(frames, code, seq=41):
    with pytest.raises(WireError) as info:
        decode_request(frames, LIMITS)
    assert info.value.code == code, info.value
    assert info.value.seq == seq
    return info.value


def test_truncated_and_missized_buffers():
    frames = _wire(encode_request(_request()))
    _expect([*frames[:1], frames[1][:-3], *frames[2:]], "bad_size")  # truncated hidden
    _expect([*frames[:2], frames[2] + b"\0\0\0\0", *frames[3:]], "bad_size")  # extra scale
    _expect([*frames[:4], frames[4][:8]], "bad_size")  # short weights
    _expect(_header_edit(frames, hidden_bytes=7), "bad_size")  # header disagrees with frame
    _expect(_header_edit(frames, num_tokens=4), "bad_size")  # shape disagrees with frames
    _expect(frames[:4], "bad_header")  # a missing buffer
    _expect([*frames, b"extra"], "bad_header")
    bf16 = _wire(encode_request(_request(torch.bfloat16)))
    _expect([*bf16[:2], b"\0" * 20, *bf16[3:]], "bad_size")  # scales on a bf16 message


def test_values_out_of_range():
    frames = _wire(encode_request(_request()))
    ids = torch.frombuffer(bytearray(frames[3]), dtype=torch.int32)
    ids[3] = LIMITS.num_experts  # one past the last expert
    _expect([*frames[:3], ids.numpy().tobytes(), frames[4]], "bad_value")
    ids[3] = -2  # -1 is allowed: an expert another member of an elastic pool computes
    _expect([*frames[:3], ids.numpy().tobytes(), frames[4]], "bad_value")
    weights = torch.frombuffer(bytearray(frames[4]), dtype=torch.float32)
    weights[0] = float("nan")
    _expect([*frames[:4], weights.numpy().tobytes()], "bad_value")
    scales = torch.frombuffer(bytearray(frames[2]), dtype=torch.float32)
    scales[1] = float("inf")
    _expect([*frames[:2], scales.numpy().tobytes(), *frames[3:]], "bad_value")
    _expect(_header_edit(frames, layer=LIMITS.num_layers), "bad_value")
    _expect(_header_edit(frames, hidden_size=LIMITS.hidden_size * 2), "bad_value")
    _expect(_header_edit(frames, hidden_dtype=7), "bad_value")
    _expect(_header_edit(frames, top_k=LIMITS.num_experts + 1), "bad_value")
    _expect(_header_edit(frames, deadline=float("nan")), "bad_value")
    big = _wire(encode_request(_request(t=LIMITS.max_tokens + 1)))
    _expect(big, "bad_value")


def test_elastic_fields_round_trip():
    """An elastic pool's message: ids of experts computed elsewhere are -1, and one member
    alone computes the shared expert and dense MLPs (skip_dense on the others)."""
    req = _request()
    ids = req.expert_ids.clone()
    ids[0, 0] = -1
    out = decode_request(
        _wire(encode_request(replace(req, expert_ids=ids, skip_dense=True))), LIMITS
    )
    assert out.skip_dense and int(out.expert_ids[0, 0]) == -1
    assert not decode_request(_wire(encode_request(req)), LIMITS).skip_dense


def test_unknown_version_and_garbage():
    frames = _wire(encode_request(_request()))
    _expect(_header_edit(frames, version=2), "bad_version")
    _expect(_header_edit(frames, version=0), "bad_header", seq=None)
    _expect([b"\xff\xfe garbage", *frames[1:]], "bad_header", seq=None)
    _expect([b"\x08" * 5000, *frames[1:]], "bad_header", seq=None)  # oversized header
    _expect([], "bad_header", seq=None)
    with pytest.raises(WireError):
        decode_reply([b"\x12\x34\x56"])
    with pytest.raises(WireError):
        decode_reply([encode_reply(FFNReply(1, 0, 0, torch.zeros(2, 4)))[0], b"\0" * 3])


def test_encoding_refuses_what_the_contract_cannot_carry():
    with pytest.raises(WireError):
        encode_request(_request(scales=None))  # fp8 without scales
    with pytest.raises(WireError):
        encode_request(_request(torch.bfloat16, layer=-1))
    with pytest.raises(WireError):
        encode_request(_request(torch.int32))
    with pytest.raises(WireError):
        encode_reply(FFNReply(1, 0, 0, output=torch.zeros(2, 4, dtype=torch.int64)))
    with pytest.raises(WireError):
        encode_reply(FFNReply(1, 0, 0, output=None))  # "ok" but nothing to send


def _decode_or_wire_error(frames) -> None:
    try:
        req = decode_request(frames, LIMITS)
    except WireError as e:
        assert e.code in WIRE_ERROR_CODES
        return
    # Whatever got through is consistent with the limits it was checked against.
    t, h = req.hidden.shape
    assert h == LIMITS.hidden_size and t <= LIMITS.max_tokens and req.layer < LIMITS.num_layers
    if req.expert_ids.numel():
        assert 0 <= int(req.expert_ids.min()) and int(req.expert_ids.max()) < LIMITS.num_experts


def _mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 4)):
        f = frames[rng.randrange(len(frames))]
        op = rng.random()
        if op < 0.5 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif op < 0.7:
            del f[rng.randrange(len(f) + 1) :]
        elif op < 0.9:
            f[rng.randrange(len(f) + 1) : 0] = rng.randbytes(rng.randint(1, 9))
        elif len(frames) > 1:
            frames.pop(rng.randrange(len(frames)))
            break
    return [bytes(f) for f in frames]


def test_random_mutations_never_crash():
    valid = [
        _wire(encode_request(_request(d, seed=s)))
        for d in (torch.float8_e4m3fn, torch.bfloat16)
        for s in range(2)
    ]
    rng = random.Random(1234)
    for i in range(3000):
        _decode_or_wire_error(_mutate(valid[i % len(valid)], rng))
    for _ in range(300):  # pure noise
        _decode_or_wire_error([rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 6))])


# property-based fuzzing where hypothesis is installed (the test extra); the loop above always runs
try:
    import hypothesis
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    hypothesis = None

if hypothesis is not None:

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(
        header=st.binary(max_size=120),
        buffers=st.lists(st.binary(max_size=200), max_size=6),
    )
    def test_fuzz_arbitrary_frames(header, buffers):
        _decode_or_wire_error([header, *buffers])

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(data=st.data())
    def test_fuzz_header_fields(data):
        # A well-formed protobuf header whose numbers lie: every field drawn at random.
        frames = _wire(encode_request(_request()))
        u32 = st.integers(0, 2**32 - 1)
        edits = data.draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "num_tokens": u32,
                    "hidden_size": u32,
                    "top_k": u32,
                    "layer": u32,
                    "hidden_dtype": st.integers(0, 5),
                    "hidden_bytes": st.integers(0, 2**64 - 1),
                    "scales_bytes": st.integers(0, 2**40),
                    "expert_ids_bytes": st.integers(0, 2**40),
                    "deadline": st.floats(allow_nan=True, allow_infinity=True),
                },
            )
        )
        _decode_or_wire_error(_header_edit(frames, **edits))


def test_no_pickle_on_the_wire_path():
    banned = re.compile(r"\b(import pickle|cloudpickle|import marshal|eval\(|exec\()")
    for rel in ("afd/wire.py", "afd/quant.py", "afd/protos.py", "afd/transport"):
        for path in (REPO / rel).rglob("*.py") if (REPO / rel).is_dir() else [REPO / rel]:
            assert not banned.search(path.read_text()), path


def test_generated_code_is_built_and_rebuilt_when_stale(tmp_path, monkeypatch):
    import os

    from afd import protos

    if not protos.PROTO_ROOT.is_dir():
        pytest.skip("installed without protos/: the wheel ships the generated code")
    files = protos.proto_files()
    assert "afd/v1/ffn.proto" in files
    protos.generate(protos.PROTO_ROOT, files, tmp_path)
    assert all(p.exists() for f in files for p in protos.outputs(f, tmp_path))

    source = protos.PROTO_ROOT / "afd/v1/ffn.proto"
    built = protos.outputs("afd/v1/ffn.proto", protos.PROTO_ROOT.parent)[1]
    old = source.stat().st_mtime - 100
    os.utime(built, (old, old))  # as if the .proto had been edited since
    monkeypatch.setattr(protos, "_checked", False)
    protos.ensure_generated()
    assert built.stat().st_mtime >= source.stat().st_mtime
    assert not list(built.parent.glob(".protoc-*"))  # its scratch directory is gone
