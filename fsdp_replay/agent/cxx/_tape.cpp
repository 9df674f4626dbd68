// The recorder's C++ tape hook (docs/architecture.md, "the tape in C++"). The Python tape
// (agent/tape.py) registers a Python kernel at the CUDA (and, for the user's ops, CPU) key of each
// taped op; this library registers a kernel of its own on top of it. On the common path (a step
// that stores no payloads, nothing else watching) a call runs the op's own kernel, launches the
// fused lin64 fingerprint of its outputs through the driver (the Triton-compiled kernel of
// fingerprint/_fused_kernel.py, whose handle Python passes down once it is compiled and checked),
// records an event and queues a fixed-size record; the recorder drains the records into the `kop`
// events the Python kernel writes, before each step's end. Everything else goes to the Python
// kernel below it: a step that stores payloads, the agent's own work, deterministic mode, a CUDA
// graph being captured, and the calls this library cannot fingerprint itself (then it keeps
// clones of the outputs for Python to fingerprint at the drain, so nothing is lost).
//
// Built against the installed torch by agent/cxx/kernel.py's builder; loaded with
// torch.ops.load_library (for the fsdpr_tape ops) and ctypes. The CUDA driver is reached through
// dlsym (torch has loaded it): no CUDA headers are needed to build this.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

extern "C" int fsdpr_sk64_many(size_t n, const uint64_t *ptrs, const uint64_t *nbytes, const int32_t *kinds,
                               uint64_t *fps, uint8_t *nfs);

#define FSDPR_TAPE_ABI 6
#define FSDPR_MAXT 4
#define FSDPR_MAXDIM 8
#define FSDPR_SLOT_WORDS 16  // fused.py: MAX_TENSORS rows of (S, A, B, nonfinite)
#define FSDPR_WORDS 8192     // fused.py: _WORDS (rows of 1024 words read by one program)

extern "C" {
// Shared with the recorder through ctypes (tape.py: State).
struct fsdpr_tape_state {
  int64_t step;
  int64_t micro;
  int64_t small_limit;  // outputs of at most this many bytes keep their bytes: Python's; -1 none
  int64_t cpu_ns;       // thread CPU time spent here, less the ops' own kernels
  int64_t calls;        // calls recorded here
  int64_t deferred;     // calls whose outputs were cloned for Python to fingerprint
  int32_t fast;         // 1: record calls here; 0: every call goes to the Python kernel
  int32_t failed;       // an internal error happened (error[] says which); calls go to Python
  char error[512];
  // The flight recorder's steps (--payloads window:N): CUDA outputs are also kept, copied on the
  // device (the program may write them in place later) and from there into pinned memory on a
  // side stream (keep_outputs), for Python to hold at the drain.
  int64_t keep_limit;  // device bytes of copies whose host copy is not done yet, at most
  int64_t keep_live;   // those bytes now
  int64_t kept;        // calls whose outputs were kept
  int64_t keep_dropped;  // calls whose outputs could not be (keep_limit, no pinned memory)
  int32_t keep;        // 1: keep CUDA outputs (only with fast)
  int32_t keep_sm;     // 1: the device copy as an elementwise kernel on the SMs, not a memcpy
  // While CUPTI traces (agent/cupti), what this hook launches for a CUDA call (the fingerprint,
  // kept copies, clones) is the agent's own: it pushes `mark_id` on CUPTI's external correlation
  // stack of `mark_kind` around it, through libcupti's functions whose addresses Python gives.
  uint64_t mark_push;  // cuptiActivityPushExternalCorrelationId, or 0
  uint64_t mark_pop;   // cuptiActivityPopExternalCorrelationId, or 0
  uint64_t mark_id;
  int32_t mark_kind;
  int32_t mark;        // 1: push it (only while CUPTI is armed)
  int64_t marks;       // calls whose launches were marked
  int64_t mark_errors; // pushes or pops CUPTI refused (then the hook stops marking: fast = 0)
  // The pinned host blocks kept outputs land in (this library's pool: see "pinned host blocks").
  int64_t host_allocs;  // blocks allocated (cuMemHostAlloc)
  int64_t host_reuses;  // kept outputs that landed in a block the pool had already
  int64_t host_bytes;   // the pool's pinned bytes, in use or free
  // Back-pressure (--when-full wait, the default): past keep_limit a call waits for the oldest
  // host copy in flight to land instead of not being kept.
  int32_t keep_wait;    // 1: wait for room; 0: not kept (counted in keep_dropped)
  int32_t pad_wait;
  int64_t keep_waits;   // calls that waited
  int64_t keep_wait_ns; // wall time they waited
};

struct fsdpr_tape_tensor {
  int64_t shape[FSDPR_MAXDIM];
  int64_t nbytes;
  uint64_t fp;  // CPU outputs: sk64, computed here
  int32_t ndim;
  int8_t dtype;  // c10::ScalarType
  int8_t cuda;   // 1: lin64 from the slot's row
  uint8_t nf;
  uint8_t pad;
};

struct fsdpr_tape_record {
  int64_t seq;
  int64_t step;
  int64_t micro;
  int64_t event;  // CUevent after which the slot holds the rows (0: none)
  int64_t ready;  // kept == 1: the CUevent after which the host copies are complete
  int32_t op;     // fsdpr_tape_add's number for the op
  int32_t slot;   // the pinned rows' slot, or -1
  int32_t ntensors;
  int32_t deferred;  // 1: the outputs are clones waiting for Python (fsdpr_tape::take)
  int32_t kept;      // 1: the outputs' bytes are on their way to pinned memory (fsdpr_tape::kept);
                     // 2: they were to be kept and could not be (dropped: Python counts them)
  int32_t pad;
  fsdpr_tape_tensor t[FSDPR_MAXT];
};
}

namespace {

// -- the CUDA driver, through dlsym ------------------------------------------------------------
typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUcontext;
typedef int CUdevice;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void **, void **) = nullptr;
  CUresult (*event_create)(CUevent *, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*event_sync)(CUevent) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
  CUresult (*event_query)(CUevent) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*is_capturing)(CUstream, int *) = nullptr;
  CUresult (*ctx_get)(CUcontext *) = nullptr;
  CUresult (*ctx_set)(CUcontext) = nullptr;
  CUresult (*primary_retain)(CUcontext *, CUdevice) = nullptr;
  CUresult (*device_get)(CUdevice *, int) = nullptr;
  CUresult (*host_alloc)(void **, size_t, unsigned) = nullptr;
  CUresult (*memcpy_dtoh_async)(void *, uint64_t, size_t, CUstream) = nullptr;
  bool loaded = false;
};
Driver drv;
const unsigned EVENT_FLAGS = 0x1 | 0x2;  // CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING

template <class F>
bool sym(void *lib, const char *name, F &out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

bool load_driver(std::string &why) {
  if (drv.loaded) return true;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) {
    why = "libcuda.so.1 is not loaded";
    return false;
  }
  bool ok = sym(lib, "cuLaunchKernel", drv.launch) && sym(lib, "cuEventCreate", drv.event_create) &&
            sym(lib, "cuEventRecord", drv.event_record) && sym(lib, "cuEventSynchronize", drv.event_sync) &&
            sym(lib, "cuEventDestroy_v2", drv.event_destroy) && sym(lib, "cuStreamIsCapturing", drv.is_capturing) &&
            sym(lib, "cuEventQuery", drv.event_query) && sym(lib, "cuStreamWaitEvent", drv.stream_wait_event) &&
            sym(lib, "cuCtxGetCurrent", drv.ctx_get) && sym(lib, "cuCtxSetCurrent", drv.ctx_set) &&
            sym(lib, "cuDevicePrimaryCtxRetain", drv.primary_retain) && sym(lib, "cuDeviceGet", drv.device_get) &&
            sym(lib, "cuMemHostAlloc", drv.host_alloc) && sym(lib, "cuMemcpyDtoHAsync_v2", drv.memcpy_dtoh_async);
  if (!ok) {
    why = "libcuda.so.1 lacks a driver function the tape uses";
    return false;
  }
  drv.loaded = true;
  return true;
}

// -- state ------------------------------------------------------------------------------------
fsdpr_tape_state state = {0, 0, -1, 0, 0, 0, 0, 0, {0}, 0, 0, 0, 0, 0, 0};
std::atomic<int64_t> next_seq{0};
thread_local int agent_depth = 0;  // the agent's own work (tape.py: agent_work), or the Python kernel's

std::mutex mu;  // records, deferred outputs, slots, events, scratch
std::vector<fsdpr_tape_record> done;
// Globals that hold tensors, events or streams are never destroyed: at the process's exit the
// CUDA context may already be gone, and freeing a CUDA tensor then aborts the process (its exit
// status lost: a failing run's most of all). The process's end frees them.
auto &deferred_outputs = *new std::unordered_map<int64_t, std::vector<at::Tensor>>;  // seq -> clones

// The fused fingerprint kernel (one device: the one it was compiled and checked on).
struct FusedKernel {
  CUfunction function = nullptr;
  int device = -1;
  unsigned threads = 0;
  unsigned shared = 0;
  bool on = false;
};
FusedKernel fused;
at::Tensor &slab = *new at::Tensor;  // pinned rows, FSDPR_SLOT_WORDS int64 a slot
std::vector<int32_t> free_slots;
std::vector<CUevent> free_events;
auto &scratch = *new std::map<std::pair<int, CUstream>, std::pair<at::Tensor, at::Tensor>>;  // (acc, count) per stream

int64_t wall_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void set_error(const std::string &what) {
  std::lock_guard<std::mutex> g(mu);
  if (!state.failed) {
    std::snprintf(state.error, sizeof(state.error), "%s", what.c_str());
    state.failed = 1;
  }
}

// The fused kernel's dtype kind (fingerprint/native.py: KINDS), or -1 for dtypes it does not read.
int kind_of(at::ScalarType st) {
  switch (st) {
    case at::kHalf: return 1;
    case at::kComplexHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kFloat: return 3;
    case at::kComplexFloat: return 3;
    case at::kDouble: return 4;
    case at::kComplexDouble: return 4;
    case at::kBool:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kUInt16:
    case at::kUInt32:
    case at::kUInt64:
      return 0;
    default:
      return -1;
  }
}

const int64_t I32 = int64_t(1) << 31;

// fused.py's _layout: a strided tensor read in place as rows of w contiguous words, in at most
// three row dimensions: (w, d1, d2, s0, s1, s2), or false where it cannot be.
bool layout_of(const at::Tensor &t, int32_t out[6]) {
  std::vector<std::pair<int64_t, int64_t>> merged;  // (size, stride), innermost first
  auto sizes = t.sizes();
  auto strides = t.strides();
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    int64_t size = sizes[d], stride = strides[d];
    if (size == 1) continue;
    if (!merged.empty() && stride == merged.back().first * merged.back().second)
      merged.back().first *= size;
    else
      merged.emplace_back(size, stride);
  }
  int64_t es = t.element_size();
  if (merged.empty() || merged[0].second != 1 || merged.size() > 4 || t.numel() * es / 4 >= I32) return false;
  int64_t w = merged[0].first * es;
  if (w % 4) return false;
  std::vector<std::pair<int64_t, int64_t>> rows(merged.rbegin(), merged.rend() - 1);  // outermost first
  for (auto &r : rows)
    if ((r.second * es) % 4 || r.second * es >= 4 * I32) return false;
  while (rows.size() < 3) rows.insert(rows.begin(), {1, 0});
  out[0] = (int32_t)(w / 4);
  out[1] = (int32_t)rows[1].first;
  out[2] = (int32_t)rows[2].first;
  for (int i = 0; i < 3; ++i) out[3 + i] = (int32_t)(rows[i].second * es / 4);
  return true;
}

// The kernel's arguments (fused.py: _arguments), in the order of its parameters; Triton appends
// two hidden scratch pointers (global and profile scratch: none for this kernel).
struct Params {
  uint64_t acc, count;
  int64_t host;
  struct {
    int64_t p;
    int32_t n, k, lay[6];
  } t[FSDPR_MAXT];
  int32_t e[3];
  uint64_t global_scratch = 0, profile_scratch = 0;
  void *ptrs[3 + FSDPR_MAXT * 9 + 3 + 2];
  int count_ptrs() {
    int i = 0;
    ptrs[i++] = &acc;
    ptrs[i++] = &count;
    ptrs[i++] = &host;
    for (auto &x : t) {
      ptrs[i++] = &x.p;
      ptrs[i++] = &x.n;
      ptrs[i++] = &x.k;
      for (auto &l : x.lay) ptrs[i++] = &l;
    }
    for (auto &x : e) ptrs[i++] = &x;
    ptrs[i++] = &global_scratch;
    ptrs[i++] = &profile_scratch;
    return i;
  }
};

bool ensure_context(int device) {
  CUcontext ctx = nullptr;
  if (drv.ctx_get(&ctx) == 0 && ctx != nullptr) return true;
  CUdevice dev;
  if (drv.device_get(&dev, device) != 0 || drv.primary_retain(&ctx, dev) != 0) return false;
  return drv.ctx_set(ctx) == 0;
}

CUstream current_stream(int device) {
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  auto s = impl->getStream(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)device));
  return (CUstream)impl->getStreamNativeHandle(s);
}

// Launch the fused kernel for `outs` (CUDA tensors of fused.device, at most FSDPR_MAXT) on the
// current stream; writes the rows into slot `slot` and records `event` after it. False where the
// kernel does not read one of them (the caller defers the call to Python).
bool launch_fused(const std::vector<at::Tensor> &outs, int32_t slot, CUevent *event, std::vector<at::Tensor> &keep,
                  std::string &why) {
  Params a{};
  int64_t blocks = 0;
  int32_t ends[FSDPR_MAXT];
  int64_t host = (int64_t)(slab.data_ptr<int64_t>() + (int64_t)slot * FSDPR_SLOT_WORDS);
  a.host = host;
  for (size_t i = 0; i < FSDPR_MAXT; ++i) {
    auto &x = a.t[i];
    if (i >= outs.size()) {
      x.p = host;
      ends[i] = (int32_t)blocks;
      continue;
    }
    at::Tensor t = outs[i];
    int k = kind_of(t.scalar_type());
    int64_t nbytes = t.numel() * (int64_t)t.element_size();
    if (k < 0 || nbytes % 4) return false;
    if (!t.is_contiguous() && !layout_of(t, x.lay)) {
      t = t.contiguous();  // the allocator orders the copy's reuse after the launch
      keep.push_back(t);
    }
    int64_t n = nbytes / 4;
    int64_t p = n ? (int64_t)t.data_ptr() : host;
    if (p % 4 || n >= I32 || p < I32) return false;
    x.p = p;
    x.n = (int32_t)n;
    x.k = k;
    blocks += (n + FSDPR_WORDS - 1) / FSDPR_WORDS;
    ends[i] = (int32_t)blocks;
  }
  for (int i = 0; i < 3; ++i) a.e[i] = ends[i];
  CUstream stream = current_stream(fused.device);
  if (blocks == 0) {
    std::memset((void *)host, 0, FSDPR_SLOT_WORDS * 8);
    *event = nullptr;
    return true;
  }
  std::pair<at::Tensor, at::Tensor> *sc;
  {
    std::lock_guard<std::mutex> g(mu);
    auto key = std::make_pair(fused.device, stream);
    auto it = scratch.find(key);
    if (it == scratch.end()) {
      auto opts = at::TensorOptions().device(at::Device(at::kCUDA, (c10::DeviceIndex)fused.device));
      it = scratch
               .emplace(key, std::make_pair(at::zeros({FSDPR_SLOT_WORDS}, opts.dtype(at::kLong)),
                                            at::zeros({1}, opts.dtype(at::kInt))))
               .first;
    }
    sc = &it->second;
  }
  a.acc = (uint64_t)sc->first.data_ptr();
  a.count = (uint64_t)sc->second.data_ptr();
  a.count_ptrs();
  if (!ensure_context(fused.device)) {
    why = "no CUDA context on this thread";
    return false;
  }
  CUresult rc = drv.launch(fused.function, (unsigned)blocks, 1, 1, fused.threads, 1, 1, fused.shared, stream, a.ptrs,
                           nullptr);
  if (rc != 0) {
    why = "cuLaunchKernel failed (CUresult " + std::to_string(rc) + ")";
    return false;
  }
  CUevent ev = nullptr;
  {
    std::lock_guard<std::mutex> g(mu);
    if (!free_events.empty()) {
      ev = free_events.back();
      free_events.pop_back();
    }
  }
  if (ev == nullptr && drv.event_create(&ev, EVENT_FLAGS) != 0) {
    why = "cuEventCreate failed";
    return false;
  }
  if (drv.event_record(ev, stream) != 0) {
    why = "cuEventRecord failed";
    return false;
  }
  *event = ev;
  return true;
}

// -- kept outputs (the flight recorder's steps) ------------------------------------------------
// A kept call's outputs are copied on the program's stream into device memory of their own (the
// program may write an output in place right after the call: autograd accumulates into them),
// and from there into pinned host memory on a side stream, behind an event: the program's stream
// runs one device-to-device copy per output and never waits for the host copy. The device copies
// are freed by a later call once the host copies' event has completed (an event query, never a
// wait); while more than keep_limit bytes of them are in flight, a call waits for the oldest host
// copy to land (keep_wait: --when-full wait, the default; counted in keep_waits, keep_wait_ns), or
// with --when-full drop its outputs are not kept (the record says so, and Python counts them
// dropped). Python takes the pinned copies at the
// drain (fsdpr_tape::kept) with the event, which it releases when done with it.
struct Landing {
  CUevent ready;
  std::vector<at::Tensor> copies;
  int64_t nbytes;
};
auto &landing = *new std::deque<Landing>;  // oldest first (never destroyed: see deferred_outputs)
auto &kept_outputs = *new std::unordered_map<int64_t, std::vector<at::Tensor>>;  // seq -> pinned copies
std::unordered_map<CUevent, int> event_refs;  // ready events: landing's reference, Python's
auto &side_streams = *new std::map<int, c10::Stream>;

CUevent take_event_locked() {
  CUevent ev = nullptr;
  if (!free_events.empty()) {
    ev = free_events.back();
    free_events.pop_back();
  } else if (drv.event_create(&ev, EVENT_FLAGS) != 0) {
    ev = nullptr;
  }
  return ev;
}

void unref_event_locked(CUevent ev) {
  auto it = event_refs.find(ev);
  if (it == event_refs.end() || --it->second > 0) return;
  event_refs.erase(it);
  free_events.push_back(ev);
}

// Free the device copies whose host copies are done, oldest first (never waits). Under mu.
void reap_locked() {
  while (!landing.empty() && drv.event_query(landing.front().ready) == 0) {
    state.keep_live -= landing.front().nbytes;
    unref_event_locked(landing.front().ready);
    landing.pop_front();  // the side stream is done with them: back to the caching allocator
  }
}

// `t`'s bytes into `c` (contiguous, as `t`) by an elementwise kernel, a bitwise OR with 0 over
// 32-bit words (bit-exact whatever the dtype), rather than copy_'s memcpy, which may queue on a
// copy engine behind the side stream's host copies (FSDP_REPLAY_SM_COPY; the payload ring's
// sm_copy does the same in Python). False where the bytes are not whole aligned words: copy_ then.
bool copy_on_sms(at::Tensor &c, const at::Tensor &t) {
  const int64_t nbytes = t.numel() * (int64_t)t.element_size();
  if (nbytes == 0 || nbytes % 4 != 0 || !t.is_contiguous() || (uintptr_t)t.data_ptr() % 4 != 0) return false;
  try {
    at::Tensor words = t.reshape({-1}).view(at::kByte).view(at::kInt);
    at::Tensor out = c.view({-1}).view(at::kByte).view(at::kInt);
    at::bitwise_or_out(out, words, at::Scalar(0));
  } catch (const std::exception &) {  // a view the dtype does not allow: nothing launched yet
    return false;
  }
  return true;
}

// -- pinned host blocks (the kept outputs' landing place) -----------------------------------------
// Kept outputs land in pinned blocks of this library's own pool, not torch's caching host
// allocator. Measured on the H200 (bench/results/gpu-session19): through torch's allocator, a
// step of window:4 made 3.35 new cudaHostAlloc calls (27 ms of the autograd thread's CPU a step)
// and its pinned memory grew by as many blocks every step: that allocator hands a freed block out
// again only after its event is processed, in order, behind every older event of the process. A
// block here is a power of two of bytes (what the flight recorder charges for it: payload_ring.py
// pinned_bytes). It goes back to the pool when its tensor dies (the flight recorder let go of it)
// and is handed out again once the copy into it is done: it holds a reference on its call's
// ready event until then. The pool keeps what it allocated (as torch's allocator does): its size
// is the most that kept outputs ever held at once (the flight recorder's bound, charged at these
// block sizes, plus the outputs not drained yet); blocks of a size no later output has stay
// unused (not trimmed); state.host_bytes says how much.
struct HostBlock {
  void *ptr;
  int64_t size;     // bytes, a power of two
  CUevent ready;    // the copy into it (one reference), or null: nothing was copied into it
  bool lost;        // a copy into it may still be running and cannot be waited on: never reused
};
std::mutex host_mu;  // the pool's own (a block comes back from any thread; never taken with mu held
                     // around code that frees tensors)
auto &host_free = *new std::unordered_map<int64_t, std::vector<HostBlock *>>;  // size -> returned

int64_t host_size(int64_t nbytes) {
  int64_t size = 1;
  while (size < nbytes) size <<= 1;
  return size;
}

// A block of `size` bytes: a returned one whose copy is done, else a new one (nullptr: none).
HostBlock *take_host_block(int64_t size) {
  HostBlock *found = nullptr;
  {
    std::lock_guard<std::mutex> g(host_mu);
    auto it = host_free.find(size);
    if (it != host_free.end()) {
      auto &list = it->second;
      for (size_t i = list.size(); i-- > 0;) {
        if (list[i]->ready == nullptr || drv.event_query(list[i]->ready) == 0) {
          found = list[i];
          list.erase(list.begin() + (std::ptrdiff_t)i);
          break;
        }
      }
    }
  }
  if (found != nullptr) {
    std::lock_guard<std::mutex> g(mu);
    if (found->ready != nullptr) unref_event_locked(found->ready);
    found->ready = nullptr;
    state.host_reuses++;
    return found;
  }
  void *ptr = nullptr;
  if (drv.host_alloc(&ptr, (size_t)size, 0) != 0 || ptr == nullptr) return nullptr;
  std::lock_guard<std::mutex> g(mu);
  state.host_allocs++;
  state.host_bytes += size;
  return new HostBlock{ptr, size, nullptr, false};
}

// `block`'s first `nbytes` as a uint8 tensor; its death gives the block back to the pool.
at::Tensor host_tensor(HostBlock *block, int64_t nbytes) {
  return at::from_blob(
      block->ptr, {nbytes},
      [block](void *) {
        if (block->lost) return;  // a copy may still write it: left to it (never freed either)
        std::lock_guard<std::mutex> g(host_mu);
        host_free[block->size].push_back(block);
      },
      at::TensorOptions().dtype(at::kByte));
}

// Keep a call's CUDA outputs (see above): 1 kept (*ready is the host copies' event), 2 not kept.
int32_t keep_outputs(int64_t seq, const std::vector<at::Tensor> &outs, int64_t *ready_out) {
  int64_t total = 0;
  for (const at::Tensor &t : outs) total += t.numel() * (int64_t)t.element_size();
  int64_t waited_from = 0;
  for (;;) {
    CUevent oldest = nullptr;
    {
      std::lock_guard<std::mutex> g(mu);
      reap_locked();
      // room, or nothing in flight (a call larger than the bound is kept alone)
      if (state.keep_live + total <= state.keep_limit || (state.keep_wait && landing.empty())) {
        state.keep_live += total;  // reserved
        break;
      }
      if (!state.keep_wait) {
        state.keep_dropped++;
        return 2;
      }
      oldest = landing.front().ready;  // landing holds a reference: not reused while queued
    }
    if (waited_from == 0) {
      waited_from = wall_ns();
      state.keep_waits++;
    }
    drv.event_sync(oldest);  // the oldest host copy lands (the program's stream is not held)
  }
  if (waited_from != 0) state.keep_wait_ns += wall_ns() - waited_from;
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Device device(c10::DeviceType::CUDA, (c10::DeviceIndex)fused.device);
  std::vector<at::Tensor> copies, hosts;
  std::vector<HostBlock *> blocks;  // hosts' blocks (the empty outputs' have none)
  CUevent copied = nullptr, ready = nullptr;
  auto give_back = [&] {  // not kept after all: the reservation and any events taken go back
    std::lock_guard<std::mutex> g(mu);
    state.keep_live -= total;
    state.keep_dropped++;
    if (copied != nullptr) free_events.push_back(copied);
    if (ready != nullptr) free_events.push_back(ready);
  };
  try {
    for (const at::Tensor &t : outs) {
      at::Tensor c = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
      if (!(state.keep_sm && copy_on_sms(c, t))) c.copy_(t);
      copies.push_back(std::move(c));
    }
    for (const at::Tensor &c : copies) {
      const int64_t nbytes = c.numel() * (int64_t)c.element_size();
      if (nbytes == 0) {
        hosts.push_back(at::empty({0}, at::TensorOptions().dtype(at::kByte)));
        continue;
      }
      HostBlock *block = take_host_block(host_size(nbytes));
      if (block == nullptr) throw std::runtime_error("no pinned host memory");
      blocks.push_back(block);
      hosts.push_back(host_tensor(block, nbytes));
    }
  } catch (const std::exception &) {  // no device or pinned memory: not kept, counted (the
                                      // blocks taken go back as hosts dies: nothing copied yet)
    give_back();
    return 2;
  }
  {
    std::lock_guard<std::mutex> g(mu);
    copied = take_event_locked();
    ready = copied != nullptr ? take_event_locked() : nullptr;
  }
  CUstream training = current_stream(fused.device);
  if (ready == nullptr || drv.event_record(copied, training) != 0) {
    give_back();
    return 2;
  }
  c10::Stream side = [&] {
    std::lock_guard<std::mutex> g(mu);
    auto it = side_streams.find(fused.device);
    if (it == side_streams.end()) it = side_streams.emplace(fused.device, impl->getStreamFromGlobalPool(device)).first;
    return it->second;
  }();
  CUstream side_handle = (CUstream)impl->getStreamNativeHandle(side);
  if (drv.stream_wait_event(side_handle, copied, 0) != 0) {
    give_back();
    return 2;
  }
  c10::DeviceGuard on_device(device);  // the driver's copies run in the current context (the side stream's)
  for (size_t i = 0; i < copies.size(); ++i) {
    if (hosts[i].numel() == 0) continue;
    if (drv.memcpy_dtoh_async(hosts[i].data_ptr(), (uint64_t)(uintptr_t)copies[i].data_ptr(),
                              (size_t)hosts[i].numel(), side_handle) != 0) {
      for (HostBlock *b : blocks) b->lost = true;  // copies already queued may write them later
      throw std::runtime_error("cuMemcpyDtoHAsync failed (kept outputs)");  // the recorder's error
    }
  }
  if (drv.event_record(ready, side_handle) != 0) {
    for (HostBlock *b : blocks) b->lost = true;
    throw std::runtime_error("cuEventRecord failed (kept outputs)");
  }
  std::lock_guard<std::mutex> g(mu);
  free_events.push_back(copied);  // the side stream's wait is queued: the event may be recorded again
  for (HostBlock *b : blocks) b->ready = ready;  // reused once it has completed
  event_refs[ready] = 2 + (int)blocks.size();  // landing's, Python's, each block's
  landing.push_back(Landing{ready, std::move(copies), total});
  kept_outputs[seq] = std::move(hosts);
  state.kept++;
  *ready_out = (int64_t)ready;
  return 1;
}

struct TapeOp {
  std::string name;  // "ns::op.overload"
  c10::OperatorHandle handle;
  c10::DispatchKey key;
  std::unique_ptr<c10::SafeKernelFunction> original;  // the op's own kernel
  std::unique_ptr<c10::SafeKernelFunction> python;    // the Python tape's kernel
  std::unique_ptr<torch::Library> lib;                // our registration on top of it
};
std::vector<std::unique_ptr<TapeOp>> ops;

void collect(const c10::IValue &v, std::vector<at::Tensor> &out) {
  if (v.isTensor()) {
    const at::Tensor &t = v.toTensor();
    if (t.defined()) out.push_back(t);
  } else if (v.isTensorList()) {
    for (const at::Tensor &t : v.toTensorList().vec())
      if (t.defined()) out.push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue &e : v.toListRef()) collect(e, out);
  } else if (v.isTuple()) {
    for (const c10::IValue &e : v.toTupleRef().elements()) collect(e, out);
  }
}

// A CUDA graph is being captured on the current stream (or this thread cannot tell: then the
// Python kernel decides). The autograd engine's device threads may have no driver context yet.
bool capturing(int device) {
  int status = 0;
  if (!ensure_context(device)) return true;
  return drv.is_capturing(current_stream(device), &status) != 0 || status != 0;
}

struct Depth {
  Depth() { ++agent_depth; }
  ~Depth() { --agent_depth; }
};

// The agent's id on CUPTI's external correlation stack of this thread while the hook launches its
// own work for a call (state.mark), so that CUPTI's records of it are told from the program's. A
// refused push or pop turns the hook off (state.fast = 0, counted in mark_errors): that call's
// launches go unmarked, and from the next call on the Python kernel, which marks its work itself,
// records every call.
typedef int (*PushExt)(int kind, uint64_t id);
typedef int (*PopExt)(int kind, uint64_t *last);
struct Mark {
  bool on = false;
  explicit Mark(bool cuda) {
    if (!cuda || !state.mark || !state.mark_push || !state.mark_pop) return;
    if (((PushExt)state.mark_push)(state.mark_kind, state.mark_id) != 0) {
      state.mark_errors++;
      state.fast = 0;
      return;
    }
    on = true;
    state.marks++;
  }
  ~Mark() {
    uint64_t last = 0;
    if (on && ((PopExt)state.mark_pop)(state.mark_kind, &last) != 0) {
      state.mark_errors++;
      state.fast = 0;
    }
  }
};

// Record one call whose outputs are `outs` (the op already ran). Returns false on an internal
// error (already said in state.error).
void record(int32_t op, const std::vector<at::Tensor> &outs) {
  fsdpr_tape_record r;
  std::memset(&r, 0, sizeof(r));
  r.seq = next_seq.fetch_add(1);
  r.step = state.step;
  r.micro = state.micro;
  r.op = op;
  r.slot = -1;
  bool cuda = !outs.empty() && outs[0].is_cuda();
  bool defer = outs.size() > FSDPR_MAXT;
  for (const at::Tensor &t : outs) {
    int64_t nbytes = t.numel() * (int64_t)t.element_size();
    if (t.is_cuda() != cuda || (cuda && t.get_device() != fused.device) || (!cuda && !t.is_cpu()) ||
        (state.small_limit >= 0 && nbytes <= state.small_limit) || t.dim() > FSDPR_MAXDIM || kind_of(t.scalar_type()) < 0)
      defer = true;
  }
  if (cuda && !fused.on) defer = true;
  if (state.keep && !cuda) defer = true;  // CPU outputs to keep: Python holds their bytes
  if (!defer) {
    r.ntensors = (int32_t)outs.size();
    for (size_t i = 0; i < outs.size(); ++i) {
      auto &d = r.t[i];
      const at::Tensor &t = outs[i];
      d.ndim = (int32_t)t.dim();
      for (int64_t j = 0; j < t.dim(); ++j) d.shape[j] = t.size(j);
      d.nbytes = t.numel() * (int64_t)t.element_size();
      d.dtype = (int8_t)t.scalar_type();
      d.cuda = cuda;
    }
    if (cuda) {
      std::vector<at::Tensor> keep;
      std::string why;
      {
        std::lock_guard<std::mutex> g(mu);
        if (!free_slots.empty()) {
          r.slot = free_slots.back();
          free_slots.pop_back();
        }
      }
      CUevent ev = nullptr;
      if (r.slot < 0) {
        defer = true;  // the writer is that far behind
      } else if (!launch_fused(outs, r.slot, &ev, keep, why)) {
        std::lock_guard<std::mutex> g(mu);
        free_slots.push_back(r.slot);
        r.slot = -1;
        if (!why.empty()) {  // a launch that failed: no more launches from here
          fused.on = false;
          std::snprintf(state.error, sizeof(state.error), "the tape's fingerprint launch: %s", why.c_str());
        }
        defer = true;
      } else {
        r.event = (int64_t)ev;
        if (state.keep) r.kept = keep_outputs(r.seq, outs, &r.ready);
      }
    } else {
      uint64_t ptrs[FSDPR_MAXT], nbytes[FSDPR_MAXT], fps[FSDPR_MAXT];
      int32_t kinds[FSDPR_MAXT];
      uint8_t nfs[FSDPR_MAXT];
      std::vector<at::Tensor> flat;
      for (size_t i = 0; i < outs.size(); ++i) {
        at::Tensor t = outs[i].is_contiguous() ? outs[i] : outs[i].contiguous();
        flat.push_back(t);
        ptrs[i] = r.t[i].nbytes ? (uint64_t)t.data_ptr() : 0;
        nbytes[i] = (uint64_t)r.t[i].nbytes;
        kinds[i] = kind_of(t.scalar_type());
      }
      if (fsdpr_sk64_many(outs.size(), ptrs, nbytes, kinds, fps, nfs) != 0) {
        defer = true;
      } else {
        for (size_t i = 0; i < outs.size(); ++i) {
          r.t[i].fp = fps[i];
          r.t[i].nf = nfs[i];
        }
      }
    }
  }
  std::lock_guard<std::mutex> g(mu);
  if (defer) {
    r.deferred = 1;
    r.ntensors = 0;
    r.slot = -1;
    r.event = 0;
    std::vector<at::Tensor> clones;
    for (const at::Tensor &t : outs) clones.push_back(t.clone());
    deferred_outputs[r.seq] = std::move(clones);
    state.deferred++;
  }
  state.calls++;
  done.push_back(r);
}

struct TapeKernel final : public c10::OperatorKernel {
  explicit TapeKernel(int32_t i) : index(i) {}
  int32_t index;

  void operator()(const c10::OperatorHandle &handle, c10::DispatchKeySet ks, torch::jit::Stack *stack) {
    TapeOp &op = *ops[index];
    bool cuda = op.key == c10::DispatchKey::CUDA;
    if (agent_depth > 0) {  // the agent's own call, or one inside a taped op's kernel: not taped
      op.original->callBoxed(handle, ks, stack);
      return;
    }
    if (!state.fast || state.failed || at::globalContext().deterministicAlgorithms() ||
        (cuda && (!fused.on || capturing(fused.device)))) {
      Depth d;  // what the Python kernel runs (its fingerprints) is the agent's
      op.python->callBoxed(handle, ks, stack);
      return;
    }
    {
      Depth d;  // taped ops that this op's kernel calls are not taped (as on the Python path)
      op.original->callBoxed(handle, ks, stack);
    }
    int64_t t0 = thread_ns();
    try {
      Depth d;  // our own ops (clones, copies) are the agent's
      Mark m(cuda);  // and so are their launches, to CUPTI
      size_t nret = handle.schema().returns().size();
      std::vector<at::Tensor> outs;
      for (size_t i = stack->size() - nret; i < stack->size(); ++i) collect((*stack)[i], outs);
      record(index, outs);
    } catch (const std::exception &e) {
      set_error(std::string("tape ") + op.name + ": " + e.what());
    } catch (...) {
      set_error(std::string("tape ") + op.name + ": an unknown exception");
    }
    state.cpu_ns += thread_ns() - t0;
  }
};

int fail(char *err, size_t n, const std::string &what) {
  std::snprintf(err, n, "%s", what.c_str());
  return -1;
}

std::optional<c10::OperatorHandle> find_op(const char *name) {
  std::string full(name);
  auto dot = full.find('.', full.find("::") + 2);
  std::string op = dot == std::string::npos ? full : full.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
  return c10::Dispatcher::singleton().findSchema({op, overload});
}

struct Quiet : c10::WarningHandler {
  void process(const c10::Warning &) override {}
};

}  // namespace

extern "C" {

int fsdpr_tape_abi(void) { return FSDPR_TAPE_ABI; }

int64_t fsdpr_tape_sizes(int which) {
  return which == 0 ? (int64_t)sizeof(fsdpr_tape_state) : (int64_t)sizeof(fsdpr_tape_record);
}

fsdpr_tape_state *fsdpr_tape_state_ptr(void) { return &state; }

// The tape's next call number (the Python path takes its numbers here too while this is attached).
int64_t fsdpr_tape_next_seq(void) { return next_seq.fetch_add(1); }

// The agent's own work begins (+1) or ends (-1) on this thread: taped calls pass to Python.
void fsdpr_tape_agent(int delta) { agent_depth += delta; }

// Before the Python tape registers its kernel for `name` ("ns::op.overload") at `key` (0 CPU,
// 1 CUDA): keep the op's own kernel. Returns the op's number, or -1 (err says why).
int fsdpr_tape_snapshot(const char *name, int key, char *err, size_t n) {
  try {
    auto handle = find_op(name);
    if (!handle) return fail(err, n, std::string("no operator ") + name);
    auto k = key == 1 ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
    auto op = std::make_unique<TapeOp>(TapeOp{name, *handle, k, nullptr, nullptr, nullptr});
    op->original = std::make_unique<c10::SafeKernelFunction>(handle->getComputedKernelForDispatchKey(k));
    ops.push_back(std::move(op));
    return (int)ops.size() - 1;
  } catch (const std::exception &e) {
    return fail(err, n, e.what());
  }
}

// After the Python tape registered its kernel for op `i`: register ours on top of it.
int fsdpr_tape_install(int i, char *err, size_t n) {
  try {
    TapeOp &op = *ops.at(i);
    op.python = std::make_unique<c10::SafeKernelFunction>(op.handle.getComputedKernelForDispatchKey(op.key));
    std::string full = op.name;
    auto sep = full.find("::");
    std::string ns = full.substr(0, sep), label = full.substr(sep + 2);
    Quiet quiet;  // "overriding a previously registered kernel": the Python tape's, on purpose
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    op.lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, op.key, __FILE__, __LINE__);
    op.lib->impl(label.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<TapeKernel>(i)));
    return 0;
  } catch (const std::exception &e) {
    return fail(err, n, e.what());
  }
}

// Remove our kernels (the Python tape's are below them) and forget the ops.
void fsdpr_tape_uninstall(void) {
  state.fast = 0;
  for (auto &op : ops) op->lib.reset();
  ops.clear();
}

// The fused kernel, compiled by Triton for `device` (its CUfunction, threads a block, shared
// memory): launches from here on. `stream` is the current stream's handle as torch's Python API
// sees it (a check that this torch hands out native stream handles). Returns 0 or -1.
int fsdpr_tape_set_kernel(uint64_t function, int device, unsigned threads, unsigned shared, uint64_t stream,
                          char *err, size_t n) {
  try {
    std::string why;
    if (!load_driver(why)) return fail(err, n, why);
    if ((uint64_t)current_stream(device) != stream)
      return fail(err, n, "the current stream's handle differs from torch.cuda.current_stream()'s");
    std::lock_guard<std::mutex> g(mu);
    if (!slab.defined()) {
      const int slots = 4096;
      slab = at::empty({slots * FSDPR_SLOT_WORDS}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
      for (int32_t s = slots - 1; s >= 0; --s) free_slots.push_back(s);
    }
    fused.function = (CUfunction)function;
    fused.device = device;
    fused.threads = threads;
    fused.shared = shared;
    fused.on = true;
    return 0;
  } catch (const std::exception &e) {
    return fail(err, n, e.what());
  }
}

// Turn the CUDA path off (a check failed): calls whose outputs are on the device go to Python.
void fsdpr_tape_cuda_off(void) { fused.on = false; }

// Up to `max` queued records, oldest first, into `out`; returns how many.
int fsdpr_tape_drain(fsdpr_tape_record *out, int max) {
  std::lock_guard<std::mutex> g(mu);
  int k = (int)std::min<size_t>(done.size(), (size_t)max);
  if (k == 0) return 0;
  std::memcpy(out, done.data(), sizeof(fsdpr_tape_record) * k);
  done.erase(done.begin(), done.begin() + k);
  return k;
}

// The rows of a record's slot, once its event is done (waits: call without the GIL); then the
// slot and the event are free again. Returns 0, or -1 when the wait failed.
int fsdpr_tape_rows(int32_t slot, int64_t event, int64_t *rows) {
  int rc = 0;
  if (event != 0 && drv.event_sync((CUevent)event) != 0) rc = -1;
  if (rc == 0) std::memcpy(rows, slab.data_ptr<int64_t>() + (int64_t)slot * FSDPR_SLOT_WORDS, FSDPR_SLOT_WORDS * 8);
  std::lock_guard<std::mutex> g(mu);
  free_slots.push_back(slot);
  if (event != 0) free_events.push_back((CUevent)event);
  return rc;
}

// A kept call's ready event (record.ready): 0 once the host copies are complete, 1 not yet,
// -1 an error; _sync waits (call without the GIL); _release: Python is done with it.
int fsdpr_tape_event_query(int64_t event) {
  CUresult rc = drv.event_query((CUevent)event);
  return rc == 0 ? 0 : rc == 600 ? 1 : -1;  // CUDA_ERROR_NOT_READY
}

int fsdpr_tape_event_sync(int64_t event) { return drv.event_sync((CUevent)event) == 0 ? 0 : -1; }

void fsdpr_tape_event_release(int64_t event) {
  std::lock_guard<std::mutex> g(mu);
  unref_event_locked((CUevent)event);
}

}  // extern "C"

namespace {

// A call's tensors in `from`, handed over (and forgotten here); none where there are none.
std::vector<at::Tensor> pop(std::unordered_map<int64_t, std::vector<at::Tensor>> &from, int64_t seq) {
  std::lock_guard<std::mutex> g(mu);
  auto it = from.find(seq);
  if (it == from.end()) return {};
  auto out = std::move(it->second);
  from.erase(it);
  return out;
}

// The clones of a deferred call's outputs, for Python to fingerprint.
std::vector<at::Tensor> take(int64_t seq) { return pop(deferred_outputs, seq); }

// The pinned copies of a kept call's outputs (their event is Python's to release).
std::vector<at::Tensor> kept(int64_t seq) { return pop(kept_outputs, seq); }

// The fused kernel launched from here for `t` (a check against Triton's own launch): its rows.
at::Tensor probe(const at::Tensor &t) {
  TORCH_CHECK(fused.on && t.is_cuda() && t.get_device() == fused.device, "the tape's CUDA path is off");
  int32_t slot;
  {
    std::lock_guard<std::mutex> g(mu);
    TORCH_CHECK(!free_slots.empty(), "no free slot");
    slot = free_slots.back();
    free_slots.pop_back();
  }
  std::vector<at::Tensor> keep;
  std::string why;
  CUevent ev = nullptr;
  bool ok = launch_fused({t}, slot, &ev, keep, why);
  at::Tensor rows = at::empty({FSDPR_SLOT_WORDS}, at::TensorOptions().dtype(at::kLong));
  if (!ok) {
    std::lock_guard<std::mutex> g(mu);
    free_slots.push_back(slot);
    TORCH_CHECK(false, "the tape's fingerprint launch: ", why.empty() ? "the kernel does not read it" : why);
  }
  TORCH_CHECK(fsdpr_tape_rows(slot, (int64_t)ev, rows.data_ptr<int64_t>()) == 0, "the event's wait failed");
  return rows;
}

}  // namespace

TORCH_LIBRARY(fsdpr_tape, m) {
  m.def("take(int seq) -> Tensor[]", &take);
  m.def("kept(int seq) -> Tensor[]", &kept);
  m.def("probe(Tensor t) -> Tensor", &probe);
}
