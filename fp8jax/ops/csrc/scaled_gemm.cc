// fp8jax's scaled FP8 GEMM: cuBLASLt's Hopper scale modes behind an XLA FFI handler.
//
// y [M, N] = a [M, K] . b [N, K]^T, both operands FP8 with K innermost (row-major), y bf16, f16
// or f32 (row-major). The scales are dequantization multipliers (f32), applied inside the GEMM:
//   kind 0 (rowwise): a_scale [M], b_scale [N]; y[i, j] = a_scale[i] b_scale[j] sum_k a b.
//   kind 1 (1 x 128 by 128 x 128): a_scale [ceil(K / 128), M], one per 128-wide tile of a row;
//     b_scale [ceil(N / 128), ceil(K / 128) padded to a multiple of 4], one per 128 x 128 block.
//   kind 2 (1 x 128 by 1 x 128): a_scale [ceil(K / 128), M], b_scale [ceil(K / 128), N].
// Block scales are promoted into the f32 accumulator every 128 of K (cuBLASLt requires it).
//
// Row-major y [M, N] is column-major y^T [N, M], so cuBLASLt computes D = op(A) op(B) with its
// m = N, n = M: A is b (column-major K x N, transposed) and B is a (column-major K x M), the
// "TN" layout Hopper's FP8 tensor cores take. The operands' second buffer is the workspace.

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowwise = 0, kBlocks = 1, kTiles = 2;

bool CudaType(ffi::DataType t, cudaDataType_t* out) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: *out = CUDA_R_8F_E4M3; return true;
    case ffi::DataType::F8E5M2: *out = CUDA_R_8F_E5M2; return true;
    case ffi::DataType::BF16: *out = CUDA_R_16BF; return true;
    case ffi::DataType::F16: *out = CUDA_R_16F; return true;
    case ffi::DataType::F32: *out = CUDA_R_32F; return true;
    default: return false;
  }
}

ffi::Error Fail(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInternal, "fp8jax scaled GEMM: " + what);
}

#define FP8JAX_LT(call)                                                              \
  do {                                                                               \
    cublasStatus_t s_ = (call);                                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                 \
      return Fail(std::string(#call) + " returned " + cublasLtGetStatusName(s_));   \
  } while (0)

// One descriptor set per GEMM call: created, used, destroyed (microseconds of host time).
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

using PlanKey = std::tuple<cudaStream_t, int64_t, int64_t, int64_t, int, int, int, int, bool>;

std::mutex mu;
std::map<cudaStream_t, cublasLtHandle_t> handles;  // one per stream: XLA runs a device's GEMMs
std::map<PlanKey, cublasLtMatmulAlgo_t> algos;     // on its own streams; heuristics once a shape

ffi::Error ScaledGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace,
                      int32_t kind, bool fast_accum) {
  auto ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || yd.size() != 2 || ad[1] != bd[1] ||
      yd[0] != ad[0] || yd[1] != bd[0])
    return Fail("want a [M, K], b [N, K] and y [M, N]");
  if (kind < kRowwise || kind > kTiles) return Fail("unknown scale kind");
  const int64_t m = ad[0], n = bd[0], k = ad[1];
  cudaDataType_t at, bt, yt;
  if (!CudaType(a.element_type(), &at) || !CudaType(b.element_type(), &bt) ||
      !CudaType(y->element_type(), &yt))
    return Fail("unsupported dtype");

  cublasLtHandle_t handle;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = handles.find(stream);
    if (it == handles.end()) {
      FP8JAX_LT(cublasLtCreate(&handle));
      handles[stream] = handle;
    } else {
      handle = it->second;
    }
  }

  Descs ds;
  FP8JAX_LT(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                           sizeof(transa)));
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                           sizeof(transb)));
  // cuBLASLt's A is our b, its B our a.
  const cublasLtMatmulMatrixScale_t a_mode =
      kind == kRowwise ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
      : kind == kBlocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                        : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const cublasLtMatmulMatrixScale_t b_mode = kind == kRowwise
                                                 ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                                 : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                           sizeof(a_mode)));
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                           sizeof(b_mode)));
  const void* a_ptr = b_scale.typed_data();
  const void* b_ptr = a_scale.typed_data();
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_ptr,
                                           sizeof(a_ptr)));
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_ptr,
                                           sizeof(b_ptr)));
  const int8_t fast = fast_accum ? 1 : 0;
  FP8JAX_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                           sizeof(fast)));
  FP8JAX_LT(cublasLtMatrixLayoutCreate(&ds.a, bt, k, n, k));
  FP8JAX_LT(cublasLtMatrixLayoutCreate(&ds.b, at, k, m, k));
  FP8JAX_LT(cublasLtMatrixLayoutCreate(&ds.d, yt, n, m, n));
  const size_t ws_bytes = workspace->size_bytes();

  const PlanKey key{stream, m, n, k, at, bt, yt, kind, fast_accum};
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = algos.find(key);
    if (it == algos.end()) {
      FP8JAX_LT(cublasLtMatmulPreferenceCreate(&ds.pref));
      FP8JAX_LT(cublasLtMatmulPreferenceSetAttribute(
          ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
      cublasLtMatmulHeuristicResult_t result = {};
      int found = 0;
      FP8JAX_LT(cublasLtMatmulAlgoGetHeuristic(handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, 1,
                                               &result, &found));
      if (found == 0)
        return Fail("cuBLASLt has no algorithm for [" + std::to_string(m) + ", " +
                    std::to_string(k) + "] x [" + std::to_string(n) + ", " +
                    std::to_string(k) + "]^T, scale kind " + std::to_string(kind));
      algos[key] = result.algo;
      algo = result.algo;
    } else {
      algo = it->second;
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  FP8JAX_LT(cublasLtMatmul(handle, ds.op, &alpha, b.untyped_data(), ds.a, a.untyped_data(), ds.b,
                           &beta, y->untyped_data(), ds.d, y->untyped_data(), ds.d, &algo,
                           workspace->untyped_data(), ws_bytes, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxScaledGemm, ScaledGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("kind")
                                  .Attr<bool>("fast_accum"));
