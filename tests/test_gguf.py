"""GGUF weights: dequantization bit-for-bit against the gguf package, and whole-model loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.errors import UnsupportedModelError, UnsupportedTensorTypeError
from kvserve.layers.attention import build_batch
from kvserve.weights.dequant import SUPPORTED_TYPES, dequantize
from kvserve.weights.loader import load_model
from tests.conftest import make_tiny_llama

T = GGMLQuantizationType
# Byte offsets of the float16 scale fields in each block layout (ggml-common.h).
HALF_OFFSETS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def random_blocks(qtype: GGMLQuantizationType, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, with finite float16 scales (random bits elsewhere)."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        halves = (rng.standard_normal(num_blocks) * rng.choice([1e-3, 1e-1, 10.0], num_blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_block_types_dequantize_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    block_elements = GGML_QUANT_SIZES[qtype][0]
    rows, blocks_per_row = 24, 3
    raw = random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, -1)
    expected = quants.dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, block_elements * blocks_per_row).numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.isfinite(expected).all()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_dequantize_bit_for_bit(qtype):
    values = np.random.default_rng(7).standard_normal((16, 48)).astype(np.float32)
    if qtype == T.F32:
        raw, expected = values, values
    elif qtype == T.F16:
        raw = values.astype(np.float16)
        expected = raw.astype(np.float32)
    else:
        raw = quants.quantize(values, T.BF16)
        expected = quants.dequantize(raw, T.BF16)
    got = dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy()), qtype, 48).numpy()
    assert np.array_equal(got.view(np.uint32), np.asarray(expected, dtype=np.float32).view(np.uint32))


def test_every_supported_type_is_tested():
    tested = set(HALF_OFFSETS) | {T.F32, T.F16, T.BF16}
    assert set(SUPPORTED_TYPES) == tested


def test_unsupported_tensor_type_is_named():
    raw = torch.zeros(1, GGML_QUANT_SIZES[T.IQ2_XXS][1], dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS, 256)


def _llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert-time reordering of Q/K rows (rotate-half -> interleaved pairs)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# transformers' module names in a Llama layer -> llama.cpp's
LLAMACPP_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_writer(path, arch: str, cfg, rope_theta: float) -> GGUFWriter:
    """A GGUFWriter with a transformers config's hyper-parameters under llama.cpp's keys."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def finish_gguf(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q6_K blocks of a float [rows, K] matrix (the gguf package quantizes no K-type), as
    raw bytes [rows, K / 256 * 210] in GGML's layout: ql (low 4 bits), qh (high 2), an int8 scale per 16
    values, a float16 scale per 256. The gguf package's dequantization is the reference it is read by."""
    rows, k = weight.shape
    w = weight.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-block, value]
    sub = np.abs(w).max(-1) / 31  # a sub-block's step, before its int8 rounding
    d = (sub.max(-1) / 127).astype(np.float16)  # [blocks]
    inv_d = np.where(d != 0, 1 / np.maximum(d.astype(np.float32), 1e-30), 0)
    scales = np.clip(np.round(sub * inv_d[:, None]), -127, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * scales.astype(np.float32)
    inv_step = np.where(step != 0, 1 / np.where(step != 0, step, 1), 0)
    codes = (np.clip(np.round(w * inv_step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (codes[:, :, :64] & 0x0F) | ((codes[:, :, 64:] & 0x0F) << 4)  # [blocks, 2, 64]
    high = (codes >> 4).reshape(-1, 2, 4, 32)  # value 32 t + i of a half: bits 2t, 2t + 1 of qh[i]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    blocks = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1
    )
    return blocks.reshape(rows, k // 256 * 210)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q5_K blocks of a float [rows, K] matrix (the gguf package quantizes no K-type), as
    raw bytes [rows, K / 256 * 176] in GGML's layout: float16 d and dmin, 6-bit scales and mins per 32
    values packed in 12 bytes, the fifth bits (qh), the low 4 bits (qs); w ~ (d * scale) * q - dmin * min.
    The gguf package's dequantization is the reference it is read by."""
    rows, k = weight.shape
    w = weight.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-block, value]
    low = np.minimum(w.min(-1), 0)  # a sub-block's offset is subtracted: at most 0
    step = (w.max(-1) - low) / 31
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)

    def six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
        unit = unit.astype(np.float32)[:, None]
        return np.clip(np.round(values / np.where(unit != 0, unit, 1)), 0, 63).astype(np.uint8)

    sc, mn = six_bits(step, d), six_bits(-low, dmin)  # [blocks, 8]
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.round((w + offset[..., None]) / np.where(scale != 0, scale, 1)[..., None])
    q = np.clip(q, 0, 31).astype(np.uint8)  # [blocks, 8, 32]
    packed = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 0x0F) | (mn[:, 4:] & 0x0F) << 4,
        ],
        axis=1,
    )
    qh = np.zeros((w.shape[0], 32), dtype=np.uint8)
    for sub in range(8):
        qh |= ((q[:, sub] >> 4) & 1) << sub
    qs = (q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)  # [blocks, 4, 32]: sub-blocks 2c and 2c + 1
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qh, qs.reshape(-1, 128)], axis=1
    )
    return blocks.reshape(rows, k // 256 * 176)


def write_llama_gguf(
    path,
    hf_model,
    arch: str = "llama",
    qtype: GGMLQuantizationType = T.F32,
    embedding_qtype: GGMLQuantizationType | None = None,
    fields: dict | None = None,
) -> None:
    """Write a transformers Llama (on the CPU) as llama.cpp's converter would (names, metadata, permuted
    Q/K; a tied lm_head not stored): matrices in `qtype`, the embedding in `embedding_qtype` (default
    `qtype`), and `fields` {key: (value, GGUFValueType, array item type or None)} added to the metadata
    (a tokenizer's, for bench/gpu.py)."""
    cfg = hf_model.config
    writer = gguf_writer(path, arch, cfg, cfg.rope_parameters["rope_theta"])
    for key, (value, kind, item_kind) in (fields or {}).items():
        writer.add_key_value(key, value, kind, item_kind)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if name in names:
            gguf_name = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{LLAMACPP_LAYER_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                data = _llamacpp_permute(data, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                data = _llamacpp_permute(data, cfg.num_key_value_heads)
        kind = (embedding_qtype or qtype) if gguf_name == "token_embd.weight" else qtype
        if data.ndim == 2 and kind != T.F32 and data.shape[1] % GGML_QUANT_SIZES[kind][0] == 0:
            own = {T.Q6_K: quantize_q6_k, T.Q5_K: quantize_q5_k}.get(kind)
            blocks = own(data) if own is not None else quants.quantize(data, kind)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    finish_gguf(writer)


def _logits(model, tokens: list[int]) -> torch.Tensor:
    model.bind_kv_cache(allocate_kv_cache(model.config, 8, 16, torch.float32, "cpu"))
    positions, metadata = build_batch([list(range(8))], [0], [len(tokens)], 16)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), positions, metadata))


def test_gguf_written_like_llamacpp_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=11)
    write_llama_gguf(tmp_path / "tiny.gguf", hf_model)
    model = load_model(tmp_path / "tiny.gguf", progress=False)
    assert not model.config.tie_word_embeddings
    tokens = list(range(3, 60, 2))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    assert (_logits(model, tokens) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_gguf_quantized_weights_load_dequantized(tmp_path, qtype):
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=12, intermediate_size=128)
    write_llama_gguf(tmp_path / "tiny-q.gguf", hf_model, qtype=qtype)
    model = load_model(tmp_path / "tiny-q.gguf", progress=False)
    embed = hf_model.model.embed_tokens.weight.detach().numpy()
    expected = quants.dequantize(quants.quantize(embed, qtype), qtype)
    assert np.array_equal(model.embed_tokens.weight.numpy(), expected)
    down = hf_model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    expected = quants.dequantize(quants.quantize(down, qtype), qtype)
    assert np.array_equal(model.layers[1].mlp.down_proj.weight.numpy(), expected)


def test_unsupported_architecture_is_named(tmp_path):
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=13)
    write_llama_gguf(tmp_path / "other.gguf", hf_model, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_model(tmp_path / "other.gguf", progress=False)


def test_not_a_gguf_file_gives_a_typed_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not gguf")
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        load_model(bad, progress=False)


def test_an_unchanged_gguf_is_parsed_once(tmp_path):
    pytest.importorskip("transformers")
    from kvserve.weights.gguf_file import open_gguf

    hf_model = make_tiny_llama(tmp_path / "hf", seed=14)
    path = tmp_path / "cached.gguf"
    write_llama_gguf(path, hf_model)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    write_llama_gguf(path, make_tiny_llama(tmp_path / "hf2", seed=15, hidden_size=32, intermediate_size=64))
    second = open_gguf(path)
    assert second is not first and second.model_config().hidden_size == 32


def test_the_sped_up_gguf_reader_reads_what_ggufs_own_does(tmp_path):
    """tests/gguf_reader.py (installed by conftest for transformers' references) hands gguf-py's reader
    a plain array of the mapped file: every field's parts, types and value indices, and every tensor,
    are what the reader as shipped finds, in a file with each kind of value and a quantized tensor."""
    from gguf import GGUFReader, GGUFValueType

    from tests.gguf_reader import ggufs_own, speed_up

    if not speed_up():
        pytest.skip("this gguf-py's reader does not map its file through module-level numpy")
    path = tmp_path / "every-kind.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_int64("custom.int64", -(2**40))
    writer.add_float64("custom.float64", 1.0 / 3.0)
    writer.add_token_list(["<s>", "▁hello", "wörld", "", "\n"])
    writer.add_token_scores([0.0, -1.5, -2.25, 3.0, -0.0])
    writer.add_token_types([3, 1, 1, 6, 1])
    writer.add_array("custom.nested", [[1, 2], [3]])
    rng = np.random.default_rng(3)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    q8 = random_blocks(T.Q8_0, 4, rng).reshape(2, -1)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=T.Q8_0)
    finish_gguf(writer)

    ours = GGUFReader(path)
    with ggufs_own():
        theirs = GGUFReader(path)
    assert type(theirs.data) is np.memmap and type(ours.data) is np.ndarray  # each took its own path
    assert list(ours.fields) == list(theirs.fields) and len(theirs.fields) == 14
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    assert theirs.fields["tokenizer.ggml.tokens"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors
    ]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.data.dtype == tensor.data.dtype and mine.data.tobytes() == tensor.data.tobytes()
