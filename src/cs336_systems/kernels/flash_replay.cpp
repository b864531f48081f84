// Replays a FlashAttention tier's recorded launches from C++, with the autograd Function in C++ too.
//
// Python records, once per shape, what a tier's forward and backward did (`flash_replay.py`): which buffers they
// allocated (shape, dtype) and which compiled Triton kernels they launched, on what grid, with which arguments:
// slots (the inputs, then the allocations) as pointers or TMA descriptors, and scalars. Here each call of that
// shape allocates the same buffers, encodes the descriptors for the new addresses and launches the same
// CUfunctions with cuLaunchKernelEx, packing the arguments as Triton's own launcher does (a descriptor is the
// CUtensorMap, then its shape as i32 and its strides as i64; then the global and profile scratch pointers, null).
// Nothing here runs Python: not the forward, not the backward on autograd's device thread.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <dlfcn.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace {

using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);

template <typename F>
F driver_function(const char* name) {
  static void* lib = dlopen("libcuda.so.1", RTLD_LAZY);
  TORCH_CHECK(lib != nullptr, "flash replay: cannot open libcuda.so.1");
  auto f = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(f != nullptr, "flash replay: libcuda.so.1 has no ", name);
  return f;
}

constexpr int kMaxRank = 5;
constexpr int kMaxArgs = 64;
constexpr int kMaxDescs = 16;

struct Arg {
  char kind;  // 'p' pointer to a slot, 'd' TMA descriptor of a slot, 'i' i32, 'l' i64, 'f' fp32
  int slot = -1;
  int64_t value = 0;
  float fvalue = 0;
  // descriptor: the slot viewed as `shape` (outermost first, contiguous strides in elements), `box` tiles
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
  cuuint32_t box[kMaxRank] = {};
  int swizzle = 0, elem_size = 0, elem_type = 0, padding = 0;
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned block, shared;
  std::vector<Arg> args;
};

struct Buffer {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct Step {
  std::vector<Buffer> inputs;   // each input's shape and dtype (checked), in slot order
  std::vector<Buffer> buffers;  // allocated per call: slots after the inputs
  std::vector<Launch> launches;
  std::vector<int> outputs;                  // slots returned
};

struct Plan {
  int device;
  Step forward, backward;
};

std::mutex plans_mutex;
std::deque<Plan> plans;  // a plan's id is its index; never removed (a deque: growing keeps references)

Arg parse_arg(const py::tuple& t) {
  Arg a;
  a.kind = t[0].cast<std::string>()[0];
  switch (a.kind) {
    case 'p':
      a.slot = t[1].cast<int>();
      break;
    case 'i':
    case 'l':
      a.value = t[1].cast<int64_t>();
      break;
    case 'f':
      a.fvalue = t[1].cast<float>();
      break;
    case 'd': {
      a.slot = t[1].cast<int>();
      auto shape = t[2].cast<std::vector<int64_t>>();
      auto box = t[3].cast<std::vector<int64_t>>();
      TORCH_CHECK(shape.size() == box.size() && !shape.empty() && shape.size() <= kMaxRank,
                  "flash replay: descriptor rank");
      a.rank = static_cast<int>(shape.size());
      int64_t stride = 1;
      for (int i = a.rank - 1; i >= 0; --i) {
        a.shape[i] = shape[i];
        a.strides[i] = stride;
        a.box[i] = static_cast<cuuint32_t>(box[i]);
        stride *= shape[i];
      }
      a.swizzle = t[4].cast<int>();
      a.elem_size = t[5].cast<int>();
      a.elem_type = t[6].cast<int>();
      a.padding = t[7].cast<int>();
      break;
    }
    default:
      TORCH_CHECK(false, "flash replay: unknown argument kind ", a.kind);
  }
  return a;
}

Step parse_step(const py::dict& d) {
  Step s;
  auto buffers = [](const py::list& list) {
    std::vector<Buffer> out;
    for (auto b : list) {
      auto t = b.cast<py::tuple>();
      // the dtype comes as an empty tensor of it: pybind converts tensors, not torch.dtype
      out.push_back({t[0].cast<std::vector<int64_t>>(), t[1].cast<at::Tensor>().scalar_type()});
    }
    return out;
  };
  s.inputs = buffers(d["inputs"].cast<py::list>());
  s.buffers = buffers(d["buffers"].cast<py::list>());
  for (auto l : d["launches"].cast<py::list>()) {
    auto t = l.cast<py::tuple>();
    Launch launch;
    launch.function = reinterpret_cast<CUfunction>(t[0].cast<uint64_t>());
    auto grid = t[1].cast<std::vector<unsigned>>();
    TORCH_CHECK(grid.size() == 3, "flash replay: grid must have 3 dims");
    std::copy(grid.begin(), grid.end(), launch.grid);
    launch.block = t[2].cast<unsigned>();
    launch.shared = t[3].cast<unsigned>();
    for (auto a : t[4].cast<py::list>()) launch.args.push_back(parse_arg(a.cast<py::tuple>()));
    TORCH_CHECK(launch.args.size() + 2 <= kMaxArgs, "flash replay: too many arguments");
    s.launches.push_back(std::move(launch));
  }
  s.outputs = d["outputs"].cast<std::vector<int>>();
  return s;
}

int64_t register_plan(int64_t device, const py::dict& forward, const py::dict& backward) {
  Plan p{static_cast<int>(device), parse_step(forward), parse_step(backward)};
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.push_back(std::move(p));
  return static_cast<int64_t>(plans.size()) - 1;
}

const Plan* find_plan(int64_t id) {
  std::lock_guard<std::mutex> lock(plans_mutex);  // the deque may grow while another thread registers
  return id >= 0 && id < static_cast<int64_t>(plans.size()) ? &plans[id] : nullptr;
}

void launch(const Launch& l, const std::vector<at::Tensor>& slots, CUstream stream) {
  static auto launch_kernel = driver_function<LaunchKernelEx>("cuLaunchKernelEx");
  static auto encode = driver_function<TensorMapEncodeTiled>("cuTensorMapEncodeTiled");
  alignas(64) CUtensorMap maps[kMaxDescs];
  int64_t values[kMaxArgs * 2 * kMaxRank];  // pointers and scalars, each in an 8-byte cell
  void* params[kMaxArgs * (1 + 2 * kMaxRank)];
  int n_params = 0, n_values = 0, n_maps = 0;
  auto cell = [&](auto v) {
    void* p = &values[n_values++];
    std::memcpy(p, &v, sizeof(v));
    params[n_params++] = p;
  };
  for (const Arg& a : l.args) {
    switch (a.kind) {
      case 'p':
        cell(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(slots[a.slot].data_ptr())));
        break;
      case 'i':
        cell(static_cast<int32_t>(a.value));
        break;
      case 'l':
        cell(static_cast<int64_t>(a.value));
        break;
      case 'f':
        cell(a.fvalue);
        break;
      case 'd': {
        TORCH_CHECK(n_maps < kMaxDescs, "flash replay: too many descriptors");
        cuuint64_t dims[kMaxRank], strides_bytes[kMaxRank];
        for (int i = 0; i < a.rank; ++i) {  // the driver takes the innermost dimension first
          dims[i] = static_cast<cuuint64_t>(a.shape[a.rank - 1 - i]);
          strides_bytes[i] = static_cast<cuuint64_t>(a.strides[a.rank - 1 - i] * a.elem_size);
        }
        cuuint32_t box[kMaxRank], element_strides[kMaxRank];
        for (int i = 0; i < a.rank; ++i) {
          box[i] = a.box[a.rank - 1 - i];
          element_strides[i] = 1;
        }
        CUtensorMap* map = &maps[n_maps++];
        CUresult r = encode(map, static_cast<CUtensorMapDataType>(a.elem_type), a.rank, slots[a.slot].data_ptr(),
                            dims, strides_bytes + 1, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            static_cast<CUtensorMapSwizzle>(a.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            a.padding ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                                      : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        TORCH_CHECK(r == CUDA_SUCCESS, "flash replay: cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
        params[n_params++] = map;
        for (int i = 0; i < a.rank; ++i) cell(static_cast<int32_t>(a.shape[i]));
        for (int i = 0; i < a.rank; ++i) cell(static_cast<int64_t>(a.strides[i]));
        break;
      }
    }
  }
  cell(static_cast<CUdeviceptr>(0));  // global scratch (the plan has none)
  cell(static_cast<CUdeviceptr>(0));  // profile scratch
  CUlaunchConfig config{};
  config.gridDimX = l.grid[0];
  config.gridDimY = l.grid[1];
  config.gridDimZ = l.grid[2];
  config.blockDimX = l.block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l.shared;
  config.hStream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  CUresult r = launch_kernel(&config, l.function, params, nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "flash replay: cuLaunchKernelEx failed (", static_cast<int>(r), ")");
}

// Whether inputs can run a step of a plan (checked before the autograd Function runs; Python says why not).
bool matches(const Plan& plan, const Step& s, const std::vector<at::Tensor>& inputs) {
  if (inputs.size() != s.inputs.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const Buffer& expected = s.inputs[i];
    if (!t.defined() || !t.is_cuda() || t.get_device() != plan.device || t.scalar_type() != expected.dtype ||
        t.numel() != c10::multiply_integers(expected.shape))
      return false;
  }
  return true;
}

std::vector<at::Tensor> run(const Step& s, std::vector<at::Tensor> slots) {
  const auto options = slots[0].options();  // before the buffers join the slots (a vector that grows)
  c10::cuda::CUDAGuard guard(options.device());
  for (const Buffer& b : s.buffers) slots.push_back(at::empty(b.shape, options.dtype(b.dtype)));
  CUstream stream = at::cuda::getCurrentCUDAStream(options.device().index()).stream();
  for (const Launch& l : s.launches) launch(l, slots, stream);
  std::vector<at::Tensor> out;
  for (int i : s.outputs) out.push_back(slots[i]);
  return out;
}

class Replay : public torch::autograd::Function<Replay> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t plan_id) {
    const Plan& plan = *find_plan(plan_id);  // `attention` checked it and the inputs
    at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();  // as the Python path
    auto out = run(plan.forward, {qc, kc, vc});  // O, L
    ctx->save_for_backward({qc, kc, vc, out[0], out[1]});
    ctx->saved_data["plan"] = plan_id;
    return out[0].view(q.sizes());
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const Plan& plan = *find_plan(ctx->saved_data["plan"].toInt());
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    at::Tensor dout = grads[0].contiguous();  // autograd checked its shape and dtype against the output's
    auto g = run(plan.backward, {q, k, v, saved[3], dout, saved[4]});  // dQ, dK, dV
    return {g[0].view(q.sizes()), g[1].view(k.sizes()), g[2].view(v.sizes()), at::Tensor()};
  }
};

// None when there is no such plan or the inputs do not match it.
py::object attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t plan_id) {
  const Plan* plan = find_plan(plan_id);
  if (plan == nullptr || !matches(*plan, plan->forward, {q, k, v})) return py::none();
  return py::cast(Replay::apply(q, k, v, plan_id));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_plan", &register_plan, "a recorded forward and backward; returns the plan's id");
  m.def("attention", &attention, "attention of q over k, v by a registered plan, differentiable; None on mismatch");
}
