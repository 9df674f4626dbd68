// Probe for the C++ kernel plan: (1) a torch::Library created and deleted at run time from a
// ctypes call registers and deregisters the kernel; (2) a custom op returns the ProcessGroup a
// kernel saw, keyed by its pointer, to Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <atomic>
#include <mutex>
#include <unordered_map>

static std::atomic<int> calls{0};
static std::mutex mu;
static std::unordered_map<int64_t, c10::intrusive_ptr<c10d::ProcessGroup>> groups;
static std::atomic<int64_t> last{0};

static void kernel(const c10::OperatorHandle &op, c10::DispatchKeySet ks, torch::jit::Stack *stack) {
  calls++;
  auto args = torch::jit::last(*stack, op.schema().arguments().size());
  auto pg = args[2].toCustomClass<c10d::ProcessGroup>();
  {
    std::lock_guard<std::mutex> g(mu);
    groups.emplace((int64_t)pg.get(), pg);
  }
  last = (int64_t)pg.get();
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

static c10::intrusive_ptr<c10d::ProcessGroup> pg_of(int64_t key) {
  std::lock_guard<std::mutex> g(mu);
  return groups.at(key);
}

extern "C" void *probe_install() {
  auto *lib = new torch::Library(torch::Library::IMPL, "c10d", c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
  lib->impl("_allgather_base_", torch::CppFunction::makeFromBoxedFunction<&kernel>());
  return lib;
}
extern "C" void probe_uninstall(void *lib) { delete static_cast<torch::Library *>(lib); }
extern "C" int probe_calls() { return calls.load(); }
extern "C" int64_t probe_last() { return last.load(); }

TORCH_LIBRARY(fsdpr_probe, m) {
  m.def("pg_of(int key) -> __torch__.torch.classes.c10d.ProcessGroup", &pg_of);
}
