// fd-lora's eager training layer in C++: the forward and backward of fdlora.kernels.train_ops._Linear's
// half-precision pair with casts made ahead (fdlora.kernels.ops.lora_train.lora_train_linear_half_cast and
// lora_train_linear_backward_half with the scale folded into the saved hs), for a plain frozen base W, as one
// torch::autograd::Function. The same ATen calls in the same order as the Python pair, so the same results bit for
// bit; what goes is the Python around them (the Function's forward and backward, each op's argument parsing), which
// on an eager SDXL step of 560 LoRA layers is most of what a layer adds to the host's time.
#include <torch/autograd.h>
#include <torch/extension.h>

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

at::Tensor mm_f32(const at::Tensor& a, const at::Tensor& b) {
  // fp32 written by the GEMM itself on CUDA; a product and a cast elsewhere (lora_train._mm_f32)
  return a.is_cuda() ? at::mm(a, b, at::kFloat) : at::mm(a, b).to(at::kFloat);
}

struct HalfLinear : public torch::autograd::Function<HalfLinear> {
  // x [..., K], A [r, K] and B [N, r] the parameters (their gradients' dtypes), W [N, K], bias [N]; Ac = A,
  // sA = s A, Bc = B, sB = s B in x's dtype. Returns y [..., N] = x W^T + bias + (x sA^T) Bc^T.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& W, const c10::optional<at::Tensor>& bias, const at::Tensor& Ac,
                            const at::Tensor& sA, const at::Tensor& Bc, const at::Tensor& sB) {
    const int64_t K = x.size(-1);
    const at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
    const at::Tensor hs = at::linear(x2, sA);  // [M, r]
    at::Tensor y = at::linear(x2, W, bias);  // [M, N]
    y.addmm_(hs, Bc.t());
    ctx->save_for_backward({x2, hs, W, Ac, sB});
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["a"] = static_cast<int64_t>(A.scalar_type());
    ctx->saved_data["b"] = static_cast<int64_t>(B.scalar_type());
    if (x.dim() == 2) return y;
    std::vector<int64_t> out = x.sizes().vec();
    out.back() = y.size(1);
    return at::_unsafe_view(y, out);  // (not a view autograd records: callers may change y in place)
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &hs = saved[1], &W = saved[2], &Ac = saved[3], &sB = saved[4];
    at::Tensor gy = grads[0];
    if (gy.dim() != 2) gy = gy.reshape({-1, gy.size(-1)});
    gy = gy.contiguous();
    if (gy.scalar_type() != x2.scalar_type()) gy = gy.to(x2.scalar_type());
    const at::Tensor g = at::mm(gy, sB);  // [M, r] = s gy B
    at::Tensor grad_B = mm_f32(gy.t(), hs);  // [N, r] = s gy^T h
    at::Tensor grad_A = mm_f32(g.t(), x2);  // [r, K]
    const auto a = static_cast<at::ScalarType>(ctx->saved_data["a"].toInt());
    const auto b = static_cast<at::ScalarType>(ctx->saved_data["b"].toInt());
    if (grad_A.scalar_type() != a) grad_A = grad_A.to(a);
    if (grad_B.scalar_type() != b) grad_B = grad_B.to(b);
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::mm(g, Ac);
      grad_x.addmm_(gy, W);  // in place: no second [M, K] gradient
      grad_x = grad_x.view(ctx->saved_data["shape"].toIntVector());
    }
    return {grad_x, grad_A, grad_B, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& W,
                       const c10::optional<at::Tensor>& bias, const at::Tensor& Ac, const at::Tensor& sA,
                       const at::Tensor& Bc, const at::Tensor& sB) {
  return HalfLinear::apply(x, A, B, W, bias, Ac, sA, Bc, sB);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("half_linear", &half_linear, "y of a trainable LoRA layer over a plain base, half-precision casts given");
}
