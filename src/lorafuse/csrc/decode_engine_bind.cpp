// Python bindings of the decode engine (decode_engine.h, decode_gemv.h), added to the extension
// module by bindings.cpp: the class `decode_engine_model` and the functions `decode_engine_*`.
#include <torch/extension.h>

#include "decode_engine.h"

namespace lorafuse {

at::Tensor quant_linear_forward(const at::Tensor& x, int64_t fmt, const at::Tensor& data,
                                const OptTensor& scales, int64_t N);

void bind_decode_engine(py::module& m) {
  using M = DecodeModel;
  py::class_<M>(m, "decode_engine_model",
                "A dense decoder in decode formats with per-sequence KV blocks and per-row LoRA "
                "adapters, its family's differences as options (csrc/decode_engine.h)",
                // module-local: several build variants (native, avx2, default) may load in one process
                py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,
                    at::Tensor, at::Tensor>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("vocab"), py::arg("layers"), py::arg("eps"),
           py::arg("attn_scale"), py::arg("cos"), py::arg("sin"))
      .def("set_weight", &M::set_weight, py::arg("layer"), py::arg("name"), py::arg("fmt"),
           py::arg("data"), py::arg("scales") = py::none())
      .def("set_vector", &M::set_vector, py::arg("layer"), py::arg("name"), py::arg("v"))
      .def("set_layer", &M::set_layer, py::arg("layer"), py::arg("rope"), py::arg("window"),
           py::arg("rope_table") = 0)
      .def("set_options", &M::set_options, py::arg("act"), py::arg("embed_scale"),
           py::arg("residual_scale"), py::arg("attn_softcap"), py::arg("logit_divisor"),
           py::arg("logit_softcap"))
      .def("set_conv", &M::set_conv, py::arg("layer"), py::arg("weight"),
           py::arg("bias") = py::none())
      .def("set_moe", &M::set_moe, py::arg("experts"), py::arg("intermediate"), py::arg("top_k"),
           py::arg("norm_topk"), py::arg("sigmoid") = false, py::arg("norm_eps") = 0.0,
           py::arg("scale") = 1.0)
      .def("set_rope", &M::set_rope, py::arg("cos"), py::arg("sin"), py::arg("table") = 0)
      .def("set_lora", &M::set_lora, py::arg("layer"), py::arg("proj"), py::arg("adapter"),
           py::arg("A"), py::arg("B"), py::arg("scale"))
      .def("clear_lora", &M::clear_lora)
      .def("reserve", &M::reserve, py::arg("slot"), py::arg("tokens"))
      .def("copy_slot", &M::copy_slot, py::arg("src"), py::arg("dst"), py::arg("tokens"))
      .def("release", &M::release, py::arg("slot"))
      .def("capacity", &M::capacity, py::arg("slot"))
      .def("cache_bytes", &M::cache_bytes)
      .def("step", &M::step, py::arg("tokens"), py::arg("slots"), py::arg("positions"),
           py::arg("adapters"), py::arg("logit_rows"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_engine_quant_linear", &quant_linear_forward,
        "x (M, K) · Wᵀ in fp32 for W in a decode format (0 fp32, 1 bf16, 2 fp16, 3 int8, 4 q4; "
        "data and scales as ops/quant_linear.py packs them)",
        py::arg("x"), py::arg("fmt"), py::arg("data"), py::arg("scales"), py::arg("n_out"));
  m.def("decode_engine_gemv_isa", [] { return std::string(gemv_isa()); },
        "Which body the decode products run here: avx512, avx2 or scalar");
  m.def("decode_engine_set_gemv_isa", [](const std::string& isa) { set_gemv_isa(isa.c_str()); },
        "Force the decode products' body (auto, avx512, avx2, scalar): for tests",
        py::arg("isa"));
}

}  // namespace lorafuse
