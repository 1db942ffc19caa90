// The Python module: each family's entry points, and the layer loop's types (kernels.h).

#include <torch/python.h>

#include <optional>
#include <vector>

#include "kernels.h"

namespace py = pybind11;
using namespace kvserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_mm", &int4_mm, "x @ W.T for an Int4Linear's packed weight, for a few rows");
  m.def("dequantize_int4", &dequantize_int4, "an Int4Linear's transposed weight in its compute dtype, [K, N]");
  m.def("int8_activations", [] { return kInt8Activations; }, "whether int4_mm can quantize activations to int8");
  m.def("int8_group_matmul", &int8_group_matmul, "x @ (codes * group scales).T in float32, [M, V]");
  m.def(
      "int8_group_matmul_int8",
      [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
        at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
        int8_group_matmul_int8(x.to(at::kFloat).contiguous(), codes, scales, out);
        return out;
      },
      "x @ (codes * group scales).T in float32, x's rows quantized to int8 per group, [M, V]");
  m.def("int8_pairs_usable", &int8_pairs_usable, "whether this build has int8_pairs_matmul (AVX512-BF16)");
  m.def("int8_pairs_matmul", &int8_pairs_matmul, "bfloat16 x @ (codes * group scales).T from interleaved codes");
  m.def("int8_quads_usable", &int8_quads_usable, "whether this build has int8_quads_matmul (AVX2, FMA and F16C; vpdpbusd on AVX512-VNNI)");
  m.def("int8_quads_matmul", &int8_quads_matmul, "int8-quantized x @ (codes * group scales).T from interleaved codes");
  m.def("float32_matmul", &float32_matmul, "x @ weight.T in float32 for a float or bfloat16 weight, [M, V]");
  m.def("dequantize_int8_groups", &dequantize_int8_groups, "rows of an int8-groups weight, [rows, K]");
  m.def("amx", &amx_usable, "whether this build runs AMX tiles (bfloat16 GEMMs then favour more rows)");
  m.def("amx_min_rows", [] { return kAmxMinRows; }, "rows from which the lm_head's AMX tiles are fastest");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (NaN largest), [B] int64");
  m.def("sample_rows", &sample_rows, "a draw per row from softmax(logits) under its seed (the exponential race), [B] int64");
  m.def("apply_token_bitmask", &apply_token_bitmask, "in place: -inf where a row's grammar bitmask forbids a token");
  m.def(
      "decode_attention",
      [](const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const LayerShape& shape, int64_t window) {
        at::Tensor out = at::empty({qkv.size(0), shape.num_heads * shape.head_dim}, qkv.options());
        decode_attention(qkv, k_cache, v_cache, block_tables, seq_lens, out, shape, window);
        return out;
      },
      "the layer loop's attention: each row of qkv over its own keys in the paged cache, [B, H D]");

  py::enum_<LinearKind>(m, "LinearKind", "how a linear layer's weight is stored")
      .value("Float", LinearKind::Float)
      .value("Int4", LinearKind::Int4)
      .value("Int8", LinearKind::Int8)
      .value("Int8Groups", LinearKind::Int8Groups)
      .value("Int8Quads", LinearKind::Int8Quads);
  py::class_<Linear>(m, "Linear", "a linear layer of the layer loop")
      .def(py::init([](LinearKind kind, at::Tensor weight, std::optional<at::Tensor> scales,
                       std::optional<at::Tensor> bias) {
             return Linear{kind, std::move(weight), scales.value_or(at::Tensor()), bias.value_or(at::Tensor())};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("bias"))
      .def_readonly("kind", &Linear::kind);
  py::enum_<Activation>(m, "Activation", "the MLP's gate activation")
      .value("SiLU", Activation::SiLU)
      .value("GeluTanh", Activation::GeluTanh);
  py::class_<LayerShape>(m, "LayerShape", "a decoder layer's sizes and its family's differences")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, Activation, bool, bool>(),
           py::kw_only(), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("rms_norm_eps"), py::arg("scale"), py::arg("rotary_dim"),
           py::arg("activation"), py::arg("qk_norm"), py::arg("sandwich_norms"));
  py::class_<Int4Policy>(m, "Int4Policy", "how the int4 layers multiply")
      .def(py::init<int64_t, int64_t, int64_t, bool>(), py::kw_only(), py::arg("group_size"), py::arg("few_rows"),
           py::arg("block_rows"), py::arg("int8_activations"));
  py::class_<LayerStack>(m, "LayerStack", "a decoder's layers, and a step through them")
      .def(py::init<std::vector<at::Tensor>, std::vector<Linear>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    LayerShape, Int4Policy, std::vector<int64_t>, std::vector<int64_t>, bool>(),
           py::arg("norms"), py::arg("linears"), py::arg("k_caches"), py::arg("v_caches"), py::arg("shape"),
           py::arg("int4"), py::arg("windows"), py::arg("rope_tables"), py::arg("final_norm"))
      // Without the GIL: the other threads of the process (a server's event loop, a pipeline's
      // receiver and heartbeat) run while a step computes.
      .def("forward", &LayerStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin_signed"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("prefill_starts"),
           py::call_guard<py::gil_scoped_release>());
}
