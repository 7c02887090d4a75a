"""`afd bench peer`'s choice of llama.cpp build: the one without AMX only for quantized weights
on a CPU with AMX-INT8 (llama.cpp's AMX kernel is what quantized weights reach there), and
that build turning on each instruction set the CPU has, AMX never."""

from afd_cli.bench import llama_cpp as peer

SPR = set("sse4_2 f16c fma bmi2 avx avx2 avx_vnni avx512f avx512cd avx512vl avx512dq".split())
SPR |= set("avx512bw avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
ZEN3 = set("sse4_2 f16c fma bmi2 avx avx2".split())


def _on(flags: list[str]) -> set[str]:
    return {f[2:-3] for f in flags if f.endswith("=ON")}


def test_no_amx_build_only_for_quantized_weights_on_amx(monkeypatch):
    monkeypatch.setattr(peer, "_cpu_flags", lambda: SPR)
    assert peer.needs_no_amx("mxfp4")
    assert not peer.needs_no_amx("bf16")
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3 | {"avx512f", "avx512_bf16"})
    assert not peer.needs_no_amx("mxfp4")


def test_no_amx_flags_follow_the_cpu(monkeypatch):
    monkeypatch.setattr(peer, "_cpu_flags", lambda: SPR)
    flags = peer._no_amx_flags()
    assert "-DGGML_NATIVE=OFF" in flags
    assert _on(flags) == {
        "GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX", "GGML_AVX2",
        "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
    }  # fmt: skip
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3)
    assert _on(peer._no_amx_flags()) == {
        "GGML_SSE42", "GGML_F16C", "GGML_FMA", "GGML_BMI2", "GGML_AVX", "GGML_AVX2",
    }  # fmt: skip
    # AVX-512 needs all five of its base parts
    monkeypatch.setattr(peer, "_cpu_flags", lambda: ZEN3 | {"avx512f", "avx512cd"})
    assert "GGML_AVX512" not in _on(peer._no_amx_flags())
