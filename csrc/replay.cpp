// The CUDA implementation of every attn:: op: replays the launches recorded for the call's
// signature, without Python.
//
// A call's signature is what its launches depend on besides its tensors' data (see
// torch_ops/backends.py): each tensor's dtype, shape, strides, device and 16-byte alignment,
// every other argument's value, and the backend requested on this thread. The first call of a
// signature goes to the Python front (redispatched to the op's CPU kernel, which is the Python
// front for every device). That call plans, runs, and records what it did: the buffers it
// allocated and each kernel launch with its arguments, every address expressed as an argument's
// or a buffer's plus an offset (torch_ops/replay.py). It stores the recording here
// (`_attn_replay::store`); later calls of the signature allocate the buffers (each result a tensor
// of its own, the others in one scratch allocation) and repeat the launches with their own
// addresses. Signatures the Python front cannot record keep going to it.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// --- the CUDA driver, resolved from the process's libcuda --------------------------------------

struct Driver {
  decltype(&cuLaunchKernel) launch = nullptr;
  decltype(&cuCtxGetCurrent) current_context = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "attn replay: cannot load libcuda.so.1: ", dlerror());
    launch = reinterpret_cast<decltype(launch)>(dlsym(lib, "cuLaunchKernel"));
    current_context = reinterpret_cast<decltype(current_context)>(dlsym(lib, "cuCtxGetCurrent"));
    error_string = reinterpret_cast<decltype(error_string)>(dlsym(lib, "cuGetErrorString"));
    TORCH_CHECK(launch && current_context && error_string, "attn replay: libcuda lacks the driver API it needs");
  }
};

const Driver& driver() {
  static Driver d;
  return d;
}

// --- recipes ------------------------------------------------------------------------------------

// Where an address comes from: nothing (null), the op's argument `index`, buffer `index`, or a
// tensor alive for the whole process (its address is the offset).
enum Source : int64_t { kNull = 0, kArgument = 1, kBuffer = 2, kConstant = 3 };

struct Address {
  int64_t source = kNull, index = 0, offset = 0;
};

// A Triton kernel parameter: an address, or a scalar of `size` bytes (little-endian `bits`).
struct Param {
  bool is_address = false;
  Address address;
  int64_t size = 0;
  uint64_t bits = 0;
};

using CEntry = int (*)(void* args, void* stream, char* error, int error_size);

struct Step {
  enum Kind : int64_t { kTriton = 1, kCCall = 2 } kind = kTriton;
  // Triton: cuLaunchKernel(function, grid, block, shared, stream, params)
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 1, shared = 0;
  std::vector<Param> params;
  // C call: entry(struct with `bytes` and the addresses patched in at `patches`, stream, ...)
  CEntry entry = nullptr;
  std::vector<uint8_t> bytes;
  std::vector<std::pair<int64_t, Address>> patches;
};

// A buffer the recorded call allocated: a result (a tensor of its own, returned), or scratch (at
// `offset` bytes into the call's one scratch allocation).
struct Buffer {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t offset = -1;  // -1: a result
};

constexpr int64_t kScratchAlign = 256;  // each scratch buffer's start (Triton specializes on 16-byte alignment)

struct Recipe {
  bool python = true;  // no recording: calls of the signature go to the Python front
  int device = 0;
  CUcontext context = nullptr;
  std::vector<Buffer> buffers;
  std::vector<int64_t> results;  // buffers returned by the op, in order
  int64_t scratch_bytes = 0;     // the scratch buffers' allocation
  std::vector<Step> steps;
};

// A signature, flattened into integers; the first is the operator's identity.
using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

constexpr size_t kMaxRecipes = 4096 * 16;  // past that the cache starts over

struct State {
  std::mutex mutex;
  std::unordered_map<Key, std::shared_ptr<const Recipe>, KeyHash> recipes;
  bool bypass = false;  // every call goes to the Python front (debug checks on)
  // per operator (its schema's address): the integer arguments keyed by their power-of-two bucket
  std::unordered_map<const void*, std::vector<int64_t>> bucketed;
  std::atomic<int64_t> replayed{0}, redispatched{0};
  std::unique_ptr<torch::Library> impls;
};

State& state() {
  static State s;
  return s;
}

thread_local int64_t requested_backend = 0;      // hash of the backend requested on this thread
thread_local const Key* pending = nullptr;       // the signature whose first call is running

template <typename T>
int64_t bits_of(T value) {
  int64_t out = 0;
  std::memcpy(&out, &value, sizeof(T));
  return out;
}

// A positive integer's power-of-two bucket (torch_ops/ops.py `bucket`); others stand for themselves.
int64_t bucket(int64_t v) {
  if (v <= 0) return v;
  int64_t b = 1;
  while (b < v) b <<= 1;
  return b;
}

// Appends the signature of `args` to `key`; false if an argument's kind is not one a signature
// covers. Besides torch_ops/backends.py's signature, it notes which tensors share an address
// (the recording resolves such an address to the first of them). The integers at the positions
// `bucketed` enter by their bucket.
bool append_signature(Key& key, c10::ArrayRef<c10::IValue> args, const std::vector<int64_t>* bucketed) {
  const void* addresses[32];
  int64_t num_tensors = 0;
  for (size_t position = 0; position < args.size(); ++position) {
    const c10::IValue& v = args[position];
    const bool by_bucket =
        bucketed != nullptr && std::find(bucketed->begin(), bucketed->end(), position) != bucketed->end();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (num_tensors == 32) return false;
      const void* address = t.data_ptr();
      int64_t first = num_tensors;
      for (int64_t j = 0; j < num_tensors && address != nullptr; ++j) {
        if (addresses[j] == address) {
          first = j;
          break;
        }
      }
      addresses[num_tensors++] = address;
      key.push_back(first);
      key.push_back(1);
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
      key.push_back(t.dim());
      for (int64_t s : t.sizes()) key.push_back(s);
      for (int64_t s : t.strides()) key.push_back(s);
      key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
    } else if (v.isNone()) {
      key.push_back(0);
    } else if (v.isInt()) {
      key.push_back(2);
      key.push_back(by_bucket ? bucket(v.toInt()) : v.toInt());
    } else if (v.isSymInt()) {
      auto s = v.toSymInt().maybe_as_int();
      if (!s) return false;
      key.push_back(2);
      key.push_back(by_bucket ? bucket(*s) : *s);
    } else if (v.isDouble()) {
      key.push_back(3);
      key.push_back(bits_of(v.toDouble()));
    } else if (v.isBool()) {
      key.push_back(4);
      key.push_back(v.toBool());
    } else {
      return false;
    }
  }
  return true;
}

[[noreturn]] void driver_failed(CUresult rc, const char* what) {
  const char* message = nullptr;
  driver().error_string(rc, &message);
  TORCH_CHECK(false, "attn replay: ", what, " failed: ", message ? message : "unknown CUDA error");
}

void replay(const Recipe& recipe, torch::jit::Stack* stack, size_t num_args) {
  c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, num_args);
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(recipe.device));
  // results: tensors of their own; scratch: addresses in one allocation, freed after the launches
  c10::SmallVector<at::Tensor, 8> results(recipe.buffers.size());   // defined for the results only
  c10::SmallVector<uint64_t, 8> buffer_addresses;
  at::Tensor scratch;
  uint64_t scratch_base = 0;
  if (recipe.scratch_bytes > 0) {
    scratch = at::detail::empty_strided_cuda({recipe.scratch_bytes}, {1}, at::kByte, device);
    scratch_base = reinterpret_cast<uint64_t>(scratch.data_ptr());
  }
  for (size_t i = 0; i < recipe.buffers.size(); ++i) {
    const Buffer& b = recipe.buffers[i];
    if (b.offset >= 0) {
      buffer_addresses.push_back(scratch_base + static_cast<uint64_t>(b.offset));
    } else {
      results[i] = at::detail::empty_strided_cuda(b.sizes, b.strides, b.dtype, device);
      buffer_addresses.push_back(reinterpret_cast<uint64_t>(results[i].data_ptr()));
    }
  }
  auto address = [&](const Address& a) -> uint64_t {
    if (a.source == kNull) return 0;
    if (a.source == kConstant) return static_cast<uint64_t>(a.offset);
    if (a.source == kBuffer) return buffer_addresses[a.index] + a.offset;
    return reinterpret_cast<uint64_t>(args[a.index].toTensor().data_ptr()) + a.offset;
  };
  CUstream stream = c10::cuda::getCurrentCUDAStream(recipe.device).stream();
  for (const Step& step : recipe.steps) {
    if (step.kind == Step::kTriton) {
      const size_t n = step.params.size();
      uint64_t values[128];
      void* params[128];
      TORCH_CHECK(n <= 128, "attn replay: too many kernel parameters");
      for (size_t i = 0; i < n; ++i) {
        const Param& p = step.params[i];
        values[i] = p.is_address ? address(p.address) : p.bits;
        params[i] = &values[i];  // little-endian: a narrower scalar is the slot's first bytes
      }
      CUresult rc = driver().launch(step.function, step.grid[0], step.grid[1], step.grid[2], step.block, 1, 1,
                                    step.shared, stream, params, nullptr);
      if (rc != CUDA_SUCCESS) driver_failed(rc, "cuLaunchKernel");
    } else {
      c10::SmallVector<uint8_t, 512> bytes(step.bytes.begin(), step.bytes.end());
      for (const auto& [offset, a] : step.patches) {
        uint64_t value = address(a);
        std::memcpy(bytes.data() + offset, &value, sizeof(value));
      }
      char error[512] = {0};
      TORCH_CHECK(step.entry(bytes.data(), stream, error, sizeof(error)) == 0, "attn replay: ", error);
    }
  }
  torch::jit::drop(*stack, num_args);
  for (int64_t r : recipe.results) stack->emplace_back(std::move(results[r]));
}

bool replayable_here(const Recipe& recipe) {
  if (recipe.python || c10::cuda::current_device() != recipe.device) return false;
  CUcontext context = nullptr;
  return driver().current_context(&context) == CUDA_SUCCESS && context == recipe.context;
}

void front(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  State& s = state();
  const size_t num_args = op.schema().arguments().size();
  Key key;
  key.reserve(64);
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&op.schema())));
  key.push_back(requested_backend);
  auto found = s.bucketed.find(&op.schema());  // written only at install
  const bool keyed = !s.bypass && append_signature(key, torch::jit::last(*stack, num_args),
                                                   found == s.bucketed.end() ? nullptr : &found->second);
  if (keyed) {
    std::shared_ptr<const Recipe> recipe;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto it = s.recipes.find(key);
      if (it != s.recipes.end()) recipe = it->second;
    }
    if (recipe && replayable_here(*recipe)) {
      replay(*recipe, stack, num_args);
      ++s.replayed;
      return;
    }
    if (!recipe) {
      // The first call: the Python front runs it and may store its recording under `key`.
      const Key* outer = pending;
      pending = &key;
      try {
        op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
      } catch (...) {
        pending = outer;
        throw;
      }
      pending = outer;
      std::lock_guard<std::mutex> lock(s.mutex);
      if (s.recipes.size() >= kMaxRecipes) s.recipes.clear();
      s.recipes.emplace(key, std::make_shared<Recipe>());  // kept if store() put one there first
      ++s.redispatched;
      return;
    }
  }
  ++s.redispatched;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// --- the control ops (called by torch_ops/replay.py) ---------------------------------------------

// Decodes a recording (its layout is written down in torch_ops/replay.py, `Recording.encode`).
void store(std::vector<int64_t> code, std::vector<at::Tensor> buffers) {
  if (pending == nullptr) return;
  auto recipe = std::make_shared<Recipe>();
  size_t i = 0;
  auto next = [&]() -> int64_t {
    TORCH_CHECK(i < code.size(), "attn replay: truncated recording");
    return code[i++];
  };
  auto next_address = [&]() {
    Address a;
    a.source = next();
    a.index = next();
    a.offset = next();
    return a;
  };
  recipe->python = false;
  recipe->device = static_cast<int>(next());
  TORCH_CHECK(driver().current_context(&recipe->context) == CUDA_SUCCESS, "attn replay: no current CUDA context");
  for (const at::Tensor& b : buffers)
    recipe->buffers.push_back({b.sizes().vec(), b.strides().vec(), b.scalar_type()});
  for (int64_t n = next(); n > 0; --n) {
    const int64_t r = next();
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(recipe->buffers.size()), "attn replay: bad result buffer");
    recipe->results.push_back(r);
  }
  for (size_t b = 0; b < recipe->buffers.size(); ++b) {
    Buffer& buffer = recipe->buffers[b];
    if (std::find(recipe->results.begin(), recipe->results.end(), static_cast<int64_t>(b)) != recipe->results.end())
      continue;
    buffer.offset = recipe->scratch_bytes;
    const int64_t bytes = static_cast<int64_t>(
        at::detail::computeStorageNbytes(buffer.sizes, buffer.strides, c10::elementSize(buffer.dtype)));
    recipe->scratch_bytes += (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  }
  for (int64_t n = next(); n > 0; --n) {
    Step step;
    step.kind = static_cast<Step::Kind>(next());
    if (step.kind == Step::kTriton) {
      step.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(next()));
      for (unsigned& g : step.grid) g = static_cast<unsigned>(next());
      step.block = static_cast<unsigned>(next());
      step.shared = static_cast<unsigned>(next());
      for (int64_t m = next(); m > 0; --m) {
        Param p;
        p.size = next();
        p.is_address = p.size == 0;
        if (p.is_address) {
          p.address = next_address();
        } else {
          p.bits = static_cast<uint64_t>(next());
        }
        step.params.push_back(p);
      }
    } else {
      TORCH_CHECK(step.kind == Step::kCCall, "attn replay: unknown step kind");
      step.entry = reinterpret_cast<CEntry>(static_cast<uintptr_t>(next()));
      step.bytes.resize(static_cast<size_t>(next()));
      for (uint8_t& byte : step.bytes) byte = static_cast<uint8_t>(next());
      for (int64_t m = next(); m > 0; --m) {
        int64_t offset = next();
        TORCH_CHECK(offset >= 0 && offset + 8 <= static_cast<int64_t>(step.bytes.size()), "attn replay: bad patch");
        step.patches.emplace_back(offset, next_address());
      }
    }
    recipe->steps.push_back(std::move(step));
  }
  TORCH_CHECK(i == code.size(), "attn replay: trailing recording data");
  std::lock_guard<std::mutex> lock(state().mutex);
  state().recipes[*pending] = std::move(recipe);
}

// `bucketed`: pairs (index into `qualnames`, argument position) of the integers keyed by bucket.
void install(std::vector<std::string> qualnames, std::vector<int64_t> bucketed) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.impls) return;
  TORCH_CHECK(bucketed.size() % 2 == 0, "attn replay: bucketed takes (op, position) pairs");
  for (size_t i = 0; i < bucketed.size(); i += 2) {
    const std::string& qualname = qualnames.at(static_cast<size_t>(bucketed[i]));
    const auto dot = qualname.find('.');
    const std::string name = "attn::" + qualname.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : qualname.substr(dot + 1);
    auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
    TORCH_CHECK(handle.has_value(), "attn replay: no operator ", qualname);
    s.bucketed[&handle->schema()].push_back(bucketed[i + 1]);
  }
  s.impls = std::make_unique<torch::Library>(torch::Library::IMPL, "attn", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  for (const std::string& name : qualnames) s.impls->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&front>());
}

void configure(bool bypass) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.bypass = bypass;
  s.recipes.clear();
}

void request(int64_t backend) { requested_backend = backend; }

std::vector<int64_t> counters() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  int64_t stored = 0;
  for (const auto& entry : s.recipes) stored += !entry.second->python;
  return {s.replayed, s.redispatched, stored};
}

}  // namespace

TORCH_LIBRARY(_attn_replay, m) {
  m.def("store(int[] code, Tensor[] buffers) -> ()", &store);
  m.def("install(str[] qualnames, int[] bucketed) -> ()", &install);
  m.def("configure(bool bypass) -> ()", &configure);
  m.def("request(int backend) -> ()", &request);
  m.def("counters() -> int[]", &counters);
}
