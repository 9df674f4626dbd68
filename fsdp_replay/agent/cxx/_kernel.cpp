// The recorder's C++ dispatcher kernel for the hot CPU collectives (docs/architecture.md, "the hot
// collectives in a C++ kernel"). It takes _allgather_base_, _reduce_scatter_base_ and allreduce_
// at AutogradCPU, ahead of the Python kernels at Autograd, fingerprints their tensors with the
// native core (_fpcore.c, linked in), and keeps fixed-size records that the recorder drains into
// the same events the Python kernels write. What it does not take goes to the Python kernel: it
// redispatches with AutogradOther in the key set, which reaches the kernel registered at the
// Autograd alias.
//
// Built against the installed torch by fsdp_replay/agent/kernel.py; loaded with
// torch.ops.load_library (for the fsdpr::pg_of op) and ctypes (for everything else). Nothing here
// takes the GIL: the dispatcher calls it with the GIL released.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" int fsdpr_sk64(const void *data, size_t nbytes, size_t slices, int kind, uint64_t *fps, uint8_t *nfs);

#define FSDPR_KERNEL_ABI 1
#define FSDPR_MAXT 4
#define FSDPR_MAXDIM 8

extern "C" {
// Shared with the recorder through ctypes (kernel.py: State). The sequence counter, step and
// micro-step are the recorder's own: the Python kernels number their collectives from here too.
struct fsdpr_state {
  int64_t seq;
  int64_t step;
  int64_t micro;
  int64_t t0;          // the recorder's time origin (CLOCK_MONOTONIC, ns)
  int64_t inflight_seq;  // the collective issued and not completed, or -1
  int64_t inflight_t_ns;
  int64_t fault_at;  // tests: an internal error at this sequence number, or -1
  int64_t inflight_pg;
  int64_t cpu_ns;  // thread CPU time spent here, less the collectives and waits it ran
  int32_t inflight_op;
  int32_t enabled;  // 0: every call goes to the Python kernel
  int32_t failed;   // an internal error happened (error[] says which); calls pass through
  int32_t pad;
  char error[512];
};

struct fsdpr_tensor {
  int64_t shape[FSDPR_MAXDIM];
  uint64_t fp;
  int32_t ndim;
  int8_t role;   // 'i' or 'o'
  int8_t dtype;  // kernel.py: DTYPES
  uint8_t nf;
  uint8_t pad;
};

struct fsdpr_record {
  int64_t seq;
  int64_t step;
  int64_t micro;
  int64_t t_ns;
  int64_t dur_ns;
  int64_t pg;  // the ProcessGroup's address: fsdpr::pg_of turns it back into the object
  int32_t op;  // 0 _allgather_base_, 1 _reduce_scatter_base_, 2 allreduce_
  int32_t reduce_op;  // c10d::ReduceOp::RedOpType, or -1
  int32_t ntensors;
  int32_t pad;
  fsdpr_tensor t[FSDPR_MAXT];
};
}

namespace {

enum Op { ALL_GATHER = 0, REDUCE_SCATTER = 1, ALL_REDUCE = 2 };

fsdpr_state state = {0, 0, 0, 0, -1, 0, -1, 0, 0, 0, 0, 0, 0, {0}};
std::mutex mu;  // records, groups; the kernel runs on whichever thread issues the collective
std::vector<fsdpr_record> done;
// Never destroyed (as _tape.cpp's tensor holders): a process group or CUDA tensor freed after the
// CUDA context or the communicators are gone at the process's exit aborts it.
auto &groups = *new std::unordered_map<int64_t, c10::intrusive_ptr<c10d::ProcessGroup>>;
torch::Library *installed = nullptr;

struct Pending {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor out, in;
  fsdpr_record rec;
  bool in_region;  // the input is inside the output (FSDP2): fingerprinted with it
};
auto &pending = *new std::vector<Pending>;  // deferred all-gathers, completed at the program's wait

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec - state.t0;
}

// Our dtype code (kernel.py: DTYPES), or 0 for dtypes the kernel leaves to Python.
int8_t dtype_code(at::ScalarType st) {
  switch (st) {
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kFloat: return 3;
    case at::kDouble: return 4;
    case at::kByte: return 5;
    case at::kChar: return 6;
    case at::kShort: return 7;
    case at::kInt: return 8;
    case at::kLong: return 9;
    case at::kBool: return 10;
    default: return 0;
  }
}

// The native core's element kind for a dtype code: the floats' 1-4 are the core's own; integers 0.
int kind_of(int8_t code) { return code <= 4 ? code : 0; }

bool plain(const at::Tensor &t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() &&
         t.dim() <= FSDPR_MAXDIM && dtype_code(t.scalar_type()) != 0;
}

int64_t thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

size_t nbytes(const at::Tensor &t) { return (size_t)t.numel() * t.element_size(); }

// FSDP frees unsharded parameters with untyped_storage().resize_(0): a tensor whose storage no
// longer holds its bytes must not be read (recording stops instead of the process crashing).
void check_storage(const at::Tensor &t) {
  size_t need = ((size_t)t.storage_offset() + (size_t)t.numel()) * t.element_size();
  if (t.numel() && (!t.data_ptr() || !t.has_storage() || t.storage().nbytes() < need))
    throw std::runtime_error("a tensor's storage was freed before it was fingerprinted");
}

// Role, dtype and shape; returns the native core's element kind.
int describe(fsdpr_tensor &r, const at::Tensor &t, char role) {
  r.dtype = dtype_code(t.scalar_type());
  r.role = role;
  r.ndim = (int32_t)t.dim();
  for (int i = 0; i < r.ndim; ++i) r.shape[i] = t.size(i);
  return kind_of(r.dtype);
}

void fingerprint(fsdpr_tensor &r, const at::Tensor &t, char role) {
  check_storage(t);
  int kind = describe(r, t, role);
  size_t n = nbytes(t);
  uint64_t fps[2];
  uint8_t nfs[2];
  if (fsdpr_sk64(n ? t.data_ptr() : nullptr, n, 1, kind, fps, nfs))
    throw std::runtime_error("native core: no memory for the row sums");
  r.fp = fps[0];
  r.nf = nfs[0];
}

// Output at t[1], and the input at t[0] when it lies inside the output, from one pass where the
// input is one of the output's equal slices of whole rows (the all-gather case); else apart.
void fingerprint_all_gather(Pending &p) {
  check_storage(p.out);
  size_t n_out = nbytes(p.out), n_in = nbytes(p.in);
  if (p.in_region && n_in && n_out % n_in == 0) {
    size_t off = (const char *)p.in.data_ptr() - (const char *)p.out.data_ptr();
    size_t slices = n_out / n_in;
    if (off % n_in == 0) {
      std::vector<uint64_t> fps(slices + 1);
      std::vector<uint8_t> nfs(slices + 1);
      int kind = describe(p.rec.t[1], p.out, 'o');
      if (fsdpr_sk64(p.out.data_ptr(), n_out, slices, kind, fps.data(), nfs.data()) == 0) {
        size_t mine = 1 + off / n_in;
        describe(p.rec.t[0], p.in, 'i');
        p.rec.t[0].fp = fps[mine];
        p.rec.t[0].nf = nfs[mine];
        p.rec.t[1].fp = fps[0];
        p.rec.t[1].nf = nfs[0];
        return;
      }
    }
  }
  if (p.in_region) fingerprint(p.rec.t[0], p.in, 'i');
  fingerprint(p.rec.t[1], p.out, 'o');
}

void finish(fsdpr_record &rec) {
  rec.dur_ns = now_ns() - rec.t_ns;
  std::lock_guard<std::mutex> g(mu);
  done.push_back(rec);
  if (state.inflight_seq == rec.seq) state.inflight_seq = -1;
}

void fail(const char *where, const char *what) {
  if (state.failed) return;
  std::snprintf(state.error, sizeof(state.error), "%s: %s", where, what);
  state.failed = 1;
  std::lock_guard<std::mutex> g(mu);
  pending.clear();
}

bool inside(const at::Tensor &in, const at::Tensor &out) {
  auto a = (uintptr_t)in.data_ptr(), lo = (uintptr_t)out.data_ptr();
  return a >= lo && a + nbytes(in) <= lo + nbytes(out);
}

bool overlap(const at::Tensor &x, const at::Tensor &y) {
  auto a = (uintptr_t)x.data_ptr(), b = (uintptr_t)y.data_ptr();
  return a < b + nbytes(y) && b < a + nbytes(x);
}

void to_python(const c10::OperatorHandle &op, c10::DispatchKeySet ks, torch::jit::Stack *stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::AutogradOther) | (ks & c10::after_autograd_keyset),
                     stack);
}

void complete(bool force) {
  std::vector<Pending> todo;
  {
    std::lock_guard<std::mutex> g(mu);
    if (pending.empty()) return;
    std::vector<Pending> keep;
    for (auto &p : pending) {
      if (force || p.work->isCompleted())
        todo.push_back(std::move(p));
      else
        keep.push_back(std::move(p));
    }
    pending.swap(keep);
  }
  for (auto &p : todo) {
    if (!p.work->isCompleted()) p.work->wait();  // the program's own error propagates to the caller
    if (state.failed) continue;
    int64_t t = thread_ns();
    try {
      fingerprint_all_gather(p);
      finish(p.rec);
    } catch (const std::exception &e) {
      fail("completing an all-gather", e.what());
    }
    state.cpu_ns += thread_ns() - t;
  }
}

template <int OP>
void kernel(const c10::OperatorHandle &op, c10::DispatchKeySet ks, torch::jit::Stack *stack) {
  if (!state.enabled || state.failed) return to_python(op, ks, stack);
  int64_t t_in = thread_ns();
  size_t n = op.schema().arguments().size();
  fsdpr_record rec;
  std::memset(&rec, 0, sizeof(rec));
  at::Tensor out, in;
  bool region = false, late = false, async_op = true;
  try {
    complete(false);
    auto args = torch::jit::last(*stack, n);
    if (OP == ALL_REDUCE) {
      // allreduce_(Tensor[] tensors, ProcessGroup pg, ReduceOp op, Tensor? sparse_indices, bool async_op, int timeout)
      auto list = args[0].toTensorList();
      if (list.size() != 1 || !args[3].isNone()) {
        state.cpu_ns += thread_ns() - t_in;
        return to_python(op, ks, stack);
      }
      out = in = list.get(0);
      async_op = args[4].toBool();
    } else {
      // _allgather_base_(Tensor out, Tensor in, ProcessGroup pg, bool async_op, int timeout)
      // _reduce_scatter_base_(Tensor out, Tensor in, ProcessGroup pg, ReduceOp op, bool async_op, int timeout)
      out = args[0].toTensor();
      in = args[1].toTensor();
      async_op = args[OP == ALL_GATHER ? 3 : 4].toBool();
    }
    if (!plain(out) || !plain(in)) {
      state.cpu_ns += thread_ns() - t_in;
      return to_python(op, ks, stack);
    }
    auto pg = args[OP == ALL_REDUCE ? 1 : 2].toCustomClass<c10d::ProcessGroup>();
    rec.pg = (int64_t)(uintptr_t)pg.get();
    {
      std::lock_guard<std::mutex> g(mu);
      if (groups.find(rec.pg) == groups.end()) groups.emplace(rec.pg, pg);
    }
    rec.reduce_op = OP == ALL_GATHER ? -1 : (int32_t)args[OP == ALL_REDUCE ? 2 : 3].toCustomClass<c10d::ReduceOp>()->op_;
    rec.op = OP;
    rec.seq = state.seq;
    if (rec.seq == state.fault_at) throw std::runtime_error("injected fault (FSDP_REPLAY_FAULT)");
    rec.step = state.step;
    rec.micro = state.micro;
    rec.ntensors = 2;
    if (OP == ALL_GATHER) {
      region = inside(in, out);
      late = !region && !overlap(in, out);
    } else if (OP == REDUCE_SCATTER) {
      late = !overlap(in, out);
    }
    if (!region && !late) fingerprint(rec.t[0], in, 'i');
    state.seq = rec.seq + 1;
    rec.t_ns = now_ns();
    state.inflight_seq = rec.seq;
    state.inflight_t_ns = rec.t_ns;
    state.inflight_op = OP;
    state.inflight_pg = rec.pg;
  } catch (const std::exception &e) {
    fail("issuing a collective", e.what());
    return to_python(op, ks, stack);  // the Python kernel records it, or passes it through
  }
  state.cpu_ns += thread_ns() - t_in;
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);  // the program's collective
  int64_t t_mid = thread_ns();
  c10::intrusive_ptr<c10d::Work> work;
  try {
    if (late) fingerprint(rec.t[0], in, 'i');  // gloo only reads it, so it is unchanged
    const c10::IValue &w = stack->back();
    if (w.isCustomClass()) work = w.toCustomClass<c10d::Work>();
    if (OP == ALL_GATHER && async_op && work) {
      {
        std::lock_guard<std::mutex> g(mu);
        pending.push_back(Pending{work, out, in, rec, region});
      }
      state.cpu_ns += thread_ns() - t_mid;
      return;  // FSDP2 waits later (prefetch): completed at that wait
    }
  } catch (const std::exception &e) {
    fail("after issuing a collective", e.what());
    return;
  }
  state.cpu_ns += thread_ns() - t_mid;
  if (work) work->wait();  // as the Python kernels do; the program's own error propagates
  int64_t t_out = thread_ns();
  try {
    if (OP == ALL_GATHER) {
      Pending p{work, out, in, rec, region};
      fingerprint_all_gather(p);
      finish(p.rec);
    } else {
      fingerprint(rec.t[1], out, 'o');
      finish(rec);
    }
  } catch (const std::exception &e) {
    fail("completing a collective", e.what());
  }
  state.cpu_ns += thread_ns() - t_out;
}

c10::intrusive_ptr<c10d::ProcessGroup> pg_of(int64_t key) {
  std::lock_guard<std::mutex> g(mu);
  auto it = groups.find(key);
  if (it == groups.end()) throw std::runtime_error("fsdpr::pg_of: unknown process group");
  return it->second;
}

}  // namespace

extern "C" {
int fsdpr_kernel_abi(void) { return FSDPR_KERNEL_ABI; }
fsdpr_state *fsdpr_kernel_state(void) { return &state; }
int fsdpr_kernel_sizes(int which) {
  return which == 0 ? (int)sizeof(fsdpr_state) : which == 1 ? (int)sizeof(fsdpr_record) : -1;
}

// Register the kernels (0), or -1 with state.error set.
int fsdpr_kernel_install(void) {
  if (installed) return 0;
  try {
    auto *lib = new torch::Library(torch::Library::IMPL, "c10d", c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
    lib->impl("_allgather_base_", torch::CppFunction::makeFromBoxedFunction<&kernel<ALL_GATHER>>());
    lib->impl("_reduce_scatter_base_", torch::CppFunction::makeFromBoxedFunction<&kernel<REDUCE_SCATTER>>());
    lib->impl("allreduce_", torch::CppFunction::makeFromBoxedFunction<&kernel<ALL_REDUCE>>());
    installed = lib;
    return 0;
  } catch (const std::exception &e) {
    std::snprintf(state.error, sizeof(state.error), "install: %s", e.what());
    return -1;
  }
}

void fsdpr_kernel_uninstall(void) {
  delete installed;
  installed = nullptr;
  state.enabled = 0;
}

// Complete the deferred all-gathers whose work is done (all of them with force, waiting). Returns
// how many completed records wait to be drained, or -1 when a wait raised the program's own error
// (its message in state.error; recording stops).
int fsdpr_kernel_complete(int force) {
  try {
    complete(force != 0);
    std::lock_guard<std::mutex> g(mu);
    return (int)done.size();
  } catch (const std::exception &e) {
    fail("waiting for an all-gather", e.what());
    return -1;
  }
}

// Move up to cap completed records to out; returns how many.
int fsdpr_kernel_drain(fsdpr_record *out, int cap) {
  std::lock_guard<std::mutex> g(mu);
  int n = (int)std::min<size_t>(done.size(), (size_t)cap);
  if (n) {
    std::memcpy(out, done.data(), n * sizeof(fsdpr_record));
    done.erase(done.begin(), done.begin() + n);
  }
  return n;
}
}

TORCH_LIBRARY(fsdpr, m) {
  m.def("pg_of(int key) -> __torch__.torch.classes.c10d.ProcessGroup", &pg_of);
}
