"""Every supported family against transformers, on tiny random models that exercise its differences:
Qwen2 (q/k/v bias; sliding layers), Qwen3 (q/k head norms, o bias, its own head_dim), Gemma 3
(scaled embeddings, 1 + w norms, sandwich norms, GELU-tanh, sliding layers with their own RoPE
base, query scaling), Phi-3 (fused qkv and gate_up, LongRoPE past the original context, partial
rotary; a sliding window), Mistral (a sliding window shorter than the prompts).

Logits within 1e-4 of transformers in float32 through the Python forward and the C++ layer loop,
over a batch prefilled, chunked and decoded on scattered blocks; greedy tokens equal through the
engine on both paths; the same models written as GGUF files the way llama.cpp's converter writes
them load to the same logits; and batch invariance: tokens alone equal those at once, behind a
prefix hit, in chunks, after preemption, in a session turn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.layers.attention import build_batch
from kvserve.layers.fused_decode import FusedDecoder
from kvserve.weights.loader import load_model, weight_summary
from tests.conftest import TINY_LLAMA, wait_idle_and_check, write_byte_tokenizer
from tests.test_batch_invariance import at_once
from tests.test_gguf import LLAMACPP_LAYER_NAMES, finish_gguf, gguf_writer

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TINY = {  # 3 layers (room for a sliding, a full and a sliding one); token ids inside the vocabulary
    **TINY_LLAMA,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WINDOW = 6
SLIDING, FULL = "sliding_attention", "full_attention"
ORIGINAL_CONTEXT = 24  # Phi-3's LongRoPE: prompts here are longer, so the long factors apply
# name -> (config class, model class, overrides)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-sliding-tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, attention_bias=True)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING],
            tie_word_embeddings=True,
        ),
    ),
    "phi3-longrope-partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=8 * ORIGINAL_CONTEXT,
            original_max_position_embeddings=ORIGINAL_CONTEXT,
            partial_rotary_factor=0.5,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.7],
                "long_factor": [1.5, 2.5, 4.0, 7.0],
            },
        ),
    ),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
}
BLOCK_SIZE = 4
NUM_BLOCKS = 96


def make_model(name: str, seed: int = 0):
    """The family's tiny random transformers model, its norm weights random too (Gemma's around 0,
    as it stores w of 1 + w; the others around 1), in eval mode."""
    config_class, model_class, overrides = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.copy_(torch.randn_like(param) * 0.3 + (0.0 if "gemma" in name else 1.0))
            elif param_name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, seed=len(request.param))
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return request.param, path, model


def prompt_lengths(name: str) -> list[int]:
    if "longrope" in name:  # all past the original context, where transformers takes the long factors too
        return [ORIGINAL_CONTEXT + n for n in (5, 13, 1, 29)]
    return [5, 13, 1, 29]  # longer and shorter than the window


def paged_logits(model, lengths: list[int], fused: bool, seed: int = 1) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each sequence's tokens and logits at every position, from steps that prefill the first
    sequences whole, a last one in chunks of 7 alongside, then decode 6 tokens each; blocks taken
    from a shuffled pool. fused: through the C++ layer loop (each token with its own block table)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    computed = [0] * len(tokens)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables: list[list[int]] = [[] for _ in tokens]
    logits: list[list[torch.Tensor]] = [[] for _ in tokens]
    chunked = len(tokens) - 1
    decoder = FusedDecoder(model) if fused else None
    for step in range(-(-lengths[chunked] // 7) + 3):  # the chunked one ends with 3 decodes
        counts = []
        for i in range(len(tokens)):
            if i == chunked and computed[i] < len(tokens[i]):
                n = min(7, len(tokens[i]) - computed[i])
            elif step == 0:
                n = len(tokens[i])
            else:
                tokens[i].append(int(torch.randint(0, vocab, (1,), generator=gen)))
                n = 1
            while len(tables[i]) * BLOCK_SIZE < computed[i] + n:
                tables[i].append(free.pop())
            counts.append(n)
        ids = torch.tensor([t for i, n in enumerate(counts) for t in tokens[i][computed[i] : computed[i] + n]])
        positions, metadata = build_batch(tables, computed, counts, BLOCK_SIZE)
        with torch.inference_mode():
            if decoder is None:
                hidden = model(ids, positions, metadata)
            else:
                width = max(len(t) for t in tables)
                rows = [tables[i] + [0] * (width - len(tables[i])) for i, n in enumerate(counts) for _ in range(n)]
                hidden = decoder.forward(ids, positions, metadata.slot_mapping, torch.tensor(rows), positions + 1)
            out = model.compute_logits(hidden)
        offset = 0
        for i, n in enumerate(counts):
            logits[i].append(out[offset : offset + n])
            offset += n
            computed[i] += n
    return tokens, [torch.cat(rows) for rows in logits]


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def load(path, dtype=torch.float32, **kwargs):
    model = load_model(path, dtype, progress=False, **kwargs)
    model.bind_kv_cache(allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu"))
    return model


@pytest.mark.parametrize("path_kind", ["python", "fused"])
def test_logits_match_transformers(family, path_kind, request):
    name, path, hf_model = family
    if path_kind == "fused":
        request.getfixturevalue("extension")
    model = load(path)
    tokens, logits = paged_logits(model, prompt_lengths(name), fused=path_kind == "fused")
    for seq_tokens, seq_logits in zip(tokens, logits, strict=True):
        assert seq_logits.shape[0] == len(seq_tokens)
        worst = (seq_logits - reference_logits(hf_model, seq_tokens)).abs().max().item()
        assert worst <= 1e-4, f"{name} {path_kind}: max |logit difference| {worst:.2e} over {len(seq_tokens)} tokens"


def test_config_reads_the_family_differences(family):
    name, path, _ = family
    config = load_model(path, progress=False).config
    windows = config.layer_windows
    expected_windows = {
        "qwen2": (0, 0, 0),
        "qwen2-sliding-tied": (0, WINDOW, WINDOW),
        "gemma3": (WINDOW, 0, WINDOW),
        "phi3-window": (WINDOW,) * 3,
        "mistral": (WINDOW,) * 3,
    }
    assert windows == expected_windows.get(name, (0, 0, 0))
    assert config.qk_norm == (name in ("qwen3", "gemma3"))
    assert config.sandwich_norms == (name == "gemma3")
    assert config.rotary_dim == (8 if "partial" in name else config.head_dim)
    assert (config.local_rope_theta is not None) == (name == "gemma3")


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "python"])
def test_greedy_tokens_match_transformers(family, fused, monkeypatch, request):
    name, path, hf_model = family
    if fused == "1":
        request.getfixturevalue("extension")
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", fused)
    prompt = torch.randint(1, 256, (prompt_lengths(name)[1],), generator=torch.Generator().manual_seed(5)).tolist()
    with LLM(path, dtype="float32", session_db=False, progress=False) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        wait_idle_and_check(llm)
    expected = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert out.token_ids == expected


def test_batching_prefix_hits_chunks_preemption_and_sessions_leave_tokens_unchanged(family, extension, tmp_path):
    """Batch invariance (R7) for the family: its greedy tokens alone equal those at once, behind a
    prefix-cache hit, prefilled in chunks of 7, after preemption in a tight pool, and a session turn
    equals the same history sent statelessly."""
    name, path, _ = family
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, 256, (prompt_lengths(name)[0] + 27,), generator=gen).tolist()
    prompts = [prefix + torch.randint(1, 256, (3 + 2 * i,), generator=gen).tolist() for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # for the tight pool: 8 short prompts whose growth (60 tokens each, 5 of its 8 blocks) no two
    # running requests can share, submitted in one call
    short = [torch.randint(1, 256, (4 + i,), generator=gen).tolist() for i in range(8)]
    longer = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", progress=False)
    with LLM(path, session_db=False, enable_prefix_caching=False, **options) as whole:
        solo = [whole.generate(p, greedy).token_ids for p in prompts]
        solo_short = [whole.generate(p, longer).token_ids for p in short]
        wait_idle_and_check(whole)
    with LLM(path, session_db=False, **options) as llm:
        hits = [llm.generate(p, greedy) for p in prompts]
        assert sum(r.usage.cached_tokens for r in hits[1:]) >= 5 * 16, "the shared prefix was not a cache hit"
        assert [r.token_ids for r in hits] == solo
        assert at_once(llm, prompts, [greedy] * len(prompts)) == solo
        wait_idle_and_check(llm)
    with LLM(path, session_db=False, max_num_batched_tokens=7, **options) as chunked:
        assert at_once(chunked, prompts, [greedy] * len(prompts)) == solo
        wait_idle_and_check(chunked)
    with LLM(path, session_db=False, kv_cache_tokens=128, enable_prefix_caching=False, **options) as tight:
        assert [r.token_ids for r in tight.generate(short, longer)] == solo_short
        assert tight.stats()["num_preemptions_total"] > 0, "the pool was not tight enough to preempt"
        wait_idle_and_check(tight)
    with LLM(path, session_db=tmp_path / "sessions.db", **options) as llm:
        with llm.session() as session:
            session.add_message("user", "hello there")
            first = session.generate(greedy)
            session.add_message("user", "and again")
            second = session.generate(greedy)
        history = [
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and again"},
        ]
        assert second.usage.cached_tokens > 0
        assert second.token_ids == llm.chat(history, greedy).token_ids
        wait_idle_and_check(llm)


# ----- the same models as GGUF files ---------------------------------------------------------------
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3", "mistral": "llama"}
LAYER_NAMES = {
    **LLAMACPP_LAYER_NAMES,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
}
GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gguf(path, name: str, hf_model, qtype) -> None:
    """Write a transformers model as llama.cpp's converter does: its tensor names, its metadata, Q/K
    rows permuted for llama (Mistral) only, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors
    as tensors."""
    from gguf import quants

    cfg = hf_model.config
    family = name.split("-")[0]
    arch = GGUF_ARCH[family]
    rope = cfg.rope_parameters.get(FULL, cfg.rope_parameters)
    writer = gguf_writer(path, arch, cfg, rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None) and family != "qwen2":
        writer.add_sliding_window(cfg.sliding_window)
    if family == "gemma3":  # llama.cpp's reader otherwise assumes every 6th layer global and 1/sqrt(head_dim)
        writer.add_sliding_window_pattern([kind == SLIDING for kind in cfg.layer_types])
        writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
    rotary = int(head_dim * rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0))
    writer.add_rope_dimension_count(rotary)
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    layer_names = {**LAYER_NAMES, **(GEMMA_NORMS if family == "gemma3" else {})}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name not in names and not hf_name.startswith("model.layers."):
            continue
        data = tensor.float().numpy()
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        if hf_name in names:
            gguf_name = names[hf_name]
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads
                data = permute_like_llamacpp(data, heads)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    finish_gguf(writer)


def permute_like_llamacpp(weights: np.ndarray, heads: int) -> np.ndarray:
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def quantized_twin(name: str, hf_model, qtype):
    """The transformers model with every 2-D weight replaced by its quantize-dequantize round trip."""
    from gguf import quants

    twin = make_model(name)
    twin.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for param in twin.parameters():
            if param.ndim == 2:
                data = param.float().numpy()
                param.copy_(torch.from_numpy(quants.dequantize(quants.quantize(data, qtype), qtype)))
    return twin


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q5_0"])
def test_gguf_written_like_llamacpp_loads_to_the_same_logits(family, qtype, tmp_path, request):
    """F32 and Q8_0 dequantized through the Python forward; Q5_0 kept as stored (weights=auto: its
    codes with a scale per 32) through the C++ loop."""
    name, _, hf_model = family
    if name == "qwen2-sliding-tied":
        pytest.skip("llama.cpp's qwen2 has no sliding layers to write")
    ggml_type = gguf.GGMLQuantizationType[qtype]
    write_gguf(tmp_path / f"{name}.gguf", name, hf_model, ggml_type)
    reference = hf_model if qtype == "F32" else quantized_twin(name, hf_model, ggml_type)
    kept = qtype == "Q5_0"
    if kept:
        request.getfixturevalue("extension")
    model = load(tmp_path / f"{name}.gguf", weights="auto" if kept else "float")
    assert not kept or set(weight_summary(model)["layers"]) == {"int8 groups", "int8 embedding"}
    tokens, logits = paged_logits(model, prompt_lengths(name), fused=kept)
    for seq_tokens, seq_logits in zip(tokens, logits, strict=True):
        worst = (seq_logits - reference_logits(reference, seq_tokens)).abs().max().item()
        assert worst <= 1e-4, f"{name} from GGUF {qtype}: max |logit difference| {worst:.2e}"


def test_a_sliding_layer_never_reads_the_blocks_behind_its_window(extension):
    """Mistral's layers all slide: once a sequence is past its window, the blocks wholly behind it
    are skipped by the C++ loop. Filled with NaN, they change nothing."""
    hf_model = make_model("mistral", seed=11)
    model = load_model_from(hf_model)
    length = 5 * BLOCK_SIZE + 1  # decoding position 20 sees 15..20 with a window of 6: blocks 0-2 are behind
    tokens = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(8, 8 + 6))
    decoder = FusedDecoder(model)
    positions, metadata = build_batch([table], [0], [length - 1], BLOCK_SIZE)
    rows = torch.tensor([table] * (length - 1))
    with torch.inference_mode():
        decoder.forward(torch.tensor(tokens[:-1]), positions, metadata.slot_mapping, rows, positions + 1)
        behind = (length - WINDOW) // BLOCK_SIZE
        for layer in model.layers:
            layer.self_attn.k_cache[table[:behind]] = float("nan")
            layer.self_attn.v_cache[table[:behind]] = float("nan")
        last = torch.tensor([length - 1])
        slot = torch.tensor([table[(length - 1) // BLOCK_SIZE] * BLOCK_SIZE + (length - 1) % BLOCK_SIZE])
        hidden = decoder.forward(torch.tensor(tokens[-1:]), last, slot, torch.tensor([table]), last + 1)
        logits = model.compute_logits(hidden)[0]
    expected = reference_logits(hf_model, tokens)[-1]
    assert (logits - expected).abs().max().item() <= 1e-4


def load_model_from(hf_model):
    """A transformers model saved to a temporary folder and loaded by kvserve, KV caches bound."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder, safe_serialization=True)
        return load(folder)
