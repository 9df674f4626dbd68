// CUPTI's activity buffers read in native code (agent/cupti/native.py loads this library).
//
// cupti-python hands its buffer callback one Python object per record; on a launch-bound step
// that per-record Python (in CUPTI's callback and then on our writer thread, both under the GIL)
// cost more than CUPTI itself. Here the buffer callbacks are ours: CUPTI's completed buffers are
// walked with libcupti's own cuptiActivityGetNextRecord, the few fields the trace keeps are
// copied into flat arrays of 64-bit words, kernel names are interned, and the buffer goes back.
// Python takes the arrays in batches (fsdpr_cupti_take, then _copy) on the writer thread.
//
// No CUPTI header is needed: libcupti is the one cupti-python loaded (found with dlopen
// RTLD_NOLOAD by its path), and the field offsets come from cupti-python's record dtypes at run
// time (fsdpr_cupti_init), which agree across the record versions of CUPTI 12 and 13 (checked
// there, not assumed here).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#define FSDPR_CUPTI_ABI 2

namespace {

typedef int (*GetNextRecord)(uint8_t*, size_t, void**);
typedef void (*Requested)(uint8_t**, size_t*, size_t*);
typedef void (*Completed)(void*, uint32_t, uint8_t*, size_t, size_t);
typedef int (*RegisterCallbacks)(Requested, Completed);
typedef void (*ApiCallback)(void*, int, uint32_t, const void*);
typedef int (*Subscribe)(void**, ApiCallback, void*);
typedef int (*EnableDomain)(uint32_t, void*, int);
typedef int (*Unsubscribe)(void*);
typedef int (*Finalize)();

// The offsets of the fields we read, per record kind (fsdpr_cupti_init's `layout`, in this order).
enum Field {
  K_START, K_END, K_DEVICE, K_STREAM, K_CORR, K_NAME,            // kernel
  C_KIND, C_BYTES, C_START, C_END, C_DEVICE, C_STREAM, C_CORR,   // memcpy
  S_BYTES, S_START, S_END, S_DEVICE, S_STREAM, S_CORR,           // memset
  A_START, A_TID, A_CORR,                                        // runtime and driver API
  E_KIND, E_ID, E_CORR,                                          // external correlation
  N_FIELDS
};
// The record kinds (CUpti_ActivityKind values, from cupti-python's enum), in this order.
enum Kind { KERNEL, MEMCPY, MEMSET, RUNTIME, DRIVER, EXTERNAL, N_KINDS };

constexpr int KERNEL_WORDS = 6;  // corr, start, end, device, stream, name code
constexpr int COPY_WORDS = 7;    // corr, start, end, device, stream, copy kind (MEMSET_CODE: a memset), bytes
constexpr int API_WORDS = 3;     // corr, start, thread id
constexpr int EXT_WORDS = 2;     // corr, external id
constexpr uint64_t MEMSET_CODE = 255;

struct Batch {
  std::vector<uint64_t> kernels, copies, api, ext;
  std::string names;  // the names first seen in this batch, each ended by a NUL
  int64_t new_names = 0;
  int64_t other = 0;  // records of kinds we did not ask for
  int64_t dropped = 0;  // kernel and copy records thrown away (while told to discard)
  void clear() {
    kernels.clear(), copies.clear(), api.clear(), ext.clear(), names.clear();
    new_names = other = dropped = 0;
  }
};

GetNextRecord g_next = nullptr;
RegisterCallbacks g_register = nullptr;
int64_t g_off[N_FIELDS];
uint32_t g_kind[N_KINDS];
uint32_t g_ext_kind = 0;
size_t g_buffer_bytes = 4 << 20;
std::mutex g_mu;  // the batch, the names, the counters
Batch g_batch, g_taken;
std::unordered_map<std::string, uint64_t> g_names;
int g_discard = 0;  // 1: records are counted, not kept (another profiler owns CUPTI, or we stopped)
int64_t g_buffers = 0, g_records = 0;
char g_error[512] = "";
// CUPTI's dynamic detach (fsdpr_cupti_detach): libcupti's functions, and where it stands.
Subscribe g_subscribe = nullptr;
EnableDomain g_enable_domain = nullptr;
Unsubscribe g_unsubscribe = nullptr;
Finalize g_finalize = nullptr;
enum Detach { D_NONE = 0, D_REQUESTED = 1, D_RUNNING = 2, D_DONE = 3 };
std::atomic<int> g_detach{D_NONE};  // or -(cuptiFinalize's error)
constexpr int DOMAIN_DRIVER = 1, DOMAIN_RUNTIME = 2;  // CUpti_CallbackDomain
constexpr int API_EXIT = 1;                           // CUpti_ApiCallbackSite

// On the exit of any runtime or driver API call once a detach is requested (whichever thread
// makes it first): cuptiFinalize, where CUPTI's documentation says it is safe to call.
void detach_callback(void*, int, uint32_t, const void* data) {
  if (data == nullptr || *(const int*)data != API_EXIT) return;  // CUpti_CallbackData.callbackSite
  int expected = D_REQUESTED;
  if (!g_detach.compare_exchange_strong(expected, D_RUNNING)) return;
  int rc = g_finalize();
  g_detach.store(rc == 0 ? D_DONE : -(rc > 0 ? rc : 1));
}

template <typename T>
inline uint64_t field(const uint8_t* r, Field f) {
  T v;
  memcpy(&v, r + g_off[f], sizeof v);
  return (uint64_t)v;
}

uint64_t intern(Batch& b, const char* name) {
  std::string_view view = name ? std::string_view(name) : std::string_view("<unknown>");
  auto it = g_names.find(std::string(view));
  if (it != g_names.end()) return it->second;
  uint64_t code = g_names.size();
  g_names.emplace(std::string(view), code);
  b.names.append(view);
  b.names.push_back('\0');
  b.new_names++;
  return code;
}

void requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = (uint8_t*)aligned_alloc(8, g_buffer_bytes);
  *size = *buffer ? g_buffer_bytes : 0;
  *max_records = 0;
}

}  // namespace

extern "C" {

int fsdpr_cupti_abi() { return FSDPR_CUPTI_ABI; }

// Read every record of a completed buffer into the batch (CUPTI's callback, or a test's buffer).
int64_t fsdpr_cupti_parse(uint8_t* buffer, size_t valid) {
  if (!g_next) return -1;
  std::lock_guard<std::mutex> lock(g_mu);
  Batch& b = g_batch;
  void* rec = nullptr;
  int64_t n = 0;
  g_buffers++;
  while (g_next(buffer, valid, &rec) == 0) {
    const uint8_t* r = (const uint8_t*)rec;
    uint32_t kind;
    memcpy(&kind, r, sizeof kind);
    n++;
    if (kind == g_kind[KERNEL]) {
      if (g_discard) { b.dropped++; continue; }
      const char* name = (const char*)field<uint64_t>(r, K_NAME);
      uint64_t row[KERNEL_WORDS] = {field<uint32_t>(r, K_CORR), field<uint64_t>(r, K_START),
                                    field<uint64_t>(r, K_END),  field<uint32_t>(r, K_DEVICE),
                                    field<uint32_t>(r, K_STREAM), intern(b, name)};
      b.kernels.insert(b.kernels.end(), row, row + KERNEL_WORDS);
    } else if (kind == g_kind[MEMCPY]) {
      if (g_discard) { b.dropped++; continue; }
      uint64_t row[COPY_WORDS] = {field<uint32_t>(r, C_CORR),   field<uint64_t>(r, C_START),
                                  field<uint64_t>(r, C_END),    field<uint32_t>(r, C_DEVICE),
                                  field<uint32_t>(r, C_STREAM), field<uint8_t>(r, C_KIND),
                                  field<uint64_t>(r, C_BYTES)};
      b.copies.insert(b.copies.end(), row, row + COPY_WORDS);
    } else if (kind == g_kind[MEMSET]) {
      if (g_discard) { b.dropped++; continue; }
      uint64_t row[COPY_WORDS] = {field<uint32_t>(r, S_CORR),   field<uint64_t>(r, S_START),
                                  field<uint64_t>(r, S_END),    field<uint32_t>(r, S_DEVICE),
                                  field<uint32_t>(r, S_STREAM), MEMSET_CODE,
                                  field<uint64_t>(r, S_BYTES)};
      b.copies.insert(b.copies.end(), row, row + COPY_WORDS);
    } else if (kind == g_kind[RUNTIME] || kind == g_kind[DRIVER]) {
      if (g_discard) continue;
      uint64_t row[API_WORDS] = {field<uint32_t>(r, A_CORR), field<uint64_t>(r, A_START),
                                 field<uint32_t>(r, A_TID)};
      b.api.insert(b.api.end(), row, row + API_WORDS);
    } else if (kind == g_kind[EXTERNAL]) {
      if (g_discard || field<uint32_t>(r, E_KIND) != g_ext_kind) continue;
      uint64_t row[EXT_WORDS] = {field<uint32_t>(r, E_CORR), field<uint64_t>(r, E_ID)};
      b.ext.insert(b.ext.end(), row, row + EXT_WORDS);
    } else {
      b.other++;
    }
  }
  g_records += n;
  return n;
}

static void completed(void*, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  if (buffer && valid) fsdpr_cupti_parse(buffer, valid);
  free(buffer);
}

// Find libcupti's functions (in the library at `path`, already loaded by cupti-python) and take
// the layout: N_FIELDS offsets, N_KINDS kind codes, the external kind we push on. 0, or -1 with
// fsdpr_cupti_error() saying why.
int fsdpr_cupti_init(const char* path, const int64_t* offsets, const uint32_t* kinds,
                     uint32_t ext_kind, int64_t buffer_bytes) {
  void* lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : nullptr;
  if (!lib && path) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(g_error, sizeof g_error, "cannot open %s: %s", path ? path : "(null)", dlerror());
    return -1;
  }
  g_next = (GetNextRecord)dlsym(lib, "cuptiActivityGetNextRecord");
  g_register = (RegisterCallbacks)dlsym(lib, "cuptiActivityRegisterCallbacks");
  if (!g_next || !g_register) {
    snprintf(g_error, sizeof g_error, "%s lacks cuptiActivityGetNextRecord/RegisterCallbacks", path);
    g_next = nullptr;
    return -1;
  }
  // optional: without them fsdpr_cupti_detach says so
  g_subscribe = (Subscribe)dlsym(lib, "cuptiSubscribe");
  g_enable_domain = (EnableDomain)dlsym(lib, "cuptiEnableDomain");
  g_unsubscribe = (Unsubscribe)dlsym(lib, "cuptiUnsubscribe");
  g_finalize = (Finalize)dlsym(lib, "cuptiFinalize");
  std::lock_guard<std::mutex> lock(g_mu);
  // a fresh start: names are numbered from 0 for the decoder that reads this library's batches
  g_batch.clear(), g_taken.clear(), g_names.clear();
  g_discard = 0, g_buffers = 0, g_records = 0;
  memcpy(g_off, offsets, sizeof g_off);
  memcpy(g_kind, kinds, sizeof g_kind);
  g_ext_kind = ext_kind;
  if (buffer_bytes > 0) g_buffer_bytes = (size_t)buffer_bytes;
  return 0;
}

// Make our buffer callbacks CUPTI's (again: another client's registration replaces them).
int fsdpr_cupti_register() {
  if (!g_register) return -1;
  int rc = g_register(requested, completed);
  if (rc != 0) snprintf(g_error, sizeof g_error, "cuptiActivityRegisterCallbacks returned %d", rc);
  return rc;
}

void fsdpr_cupti_discard(int on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_discard = on;
}

// Swap the batch out for reading; `counts` gets: kernels, copies, api, ext rows, new names, the
// names' bytes, other, dropped, and (cumulative) buffers, records. Call _copy next, before any
// other take.
void fsdpr_cupti_take(int64_t* counts) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_taken.clear();
  std::swap(g_taken, g_batch);
  counts[0] = g_taken.kernels.size() / KERNEL_WORDS;
  counts[1] = g_taken.copies.size() / COPY_WORDS;
  counts[2] = g_taken.api.size() / API_WORDS;
  counts[3] = g_taken.ext.size() / EXT_WORDS;
  counts[4] = g_taken.new_names;
  counts[5] = (int64_t)g_taken.names.size();
  counts[6] = g_taken.other;
  counts[7] = g_taken.dropped;
  counts[8] = g_buffers;
  counts[9] = g_records;
}

// Copy the taken batch into the caller's arrays (sized from fsdpr_cupti_take's counts).
void fsdpr_cupti_copy(uint64_t* kernels, uint64_t* copies, uint64_t* api, uint64_t* ext, char* names) {
  const Batch& b = g_taken;
  if (!b.kernels.empty()) memcpy(kernels, b.kernels.data(), b.kernels.size() * 8);
  if (!b.copies.empty()) memcpy(copies, b.copies.data(), b.copies.size() * 8);
  if (!b.api.empty()) memcpy(api, b.api.data(), b.api.size() * 8);
  if (!b.ext.empty()) memcpy(ext, b.ext.data(), b.ext.size() * 8);
  if (!b.names.empty()) memcpy(names, b.names.data(), b.names.size());
}

const char* fsdpr_cupti_error() { return g_error; }

// Ask for CUPTI's dynamic detach: a subscription to the runtime and driver API callbacks whose
// first API exit (any thread's) calls cuptiFinalize, which ends CUPTI's interception of every CUDA
// call (once CUPTI has traced, it stays in every call's path until then) and forgets every
// setting: kinds, buffer callbacks, subscriptions. Activity can be enabled again afterwards, when
// CUPTI initializes itself anew. The caller makes a CUDA call next and reads fsdpr_cupti_detached.
// 0, or -1 (fsdpr_cupti_error says why: this libcupti lacks the calls, another client holds the
// subscription).
int fsdpr_cupti_detach() {
  if (!g_subscribe || !g_enable_domain || !g_unsubscribe || !g_finalize) {
    snprintf(g_error, sizeof g_error, "this libcupti lacks cuptiSubscribe/EnableDomain/Unsubscribe/Finalize");
    return -1;
  }
  int state = g_detach.load();
  if (state == D_REQUESTED || state == D_RUNNING) return 0;  // one is pending already
  void* sub = nullptr;
  int rc = g_subscribe(&sub, detach_callback, nullptr);
  if (rc != 0) {
    snprintf(g_error, sizeof g_error, "cuptiSubscribe returned %d", rc);
    return -1;
  }
  g_detach.store(D_REQUESTED);
  for (int domain : {DOMAIN_RUNTIME, DOMAIN_DRIVER}) {
    rc = g_enable_domain(1, sub, domain);
    if (rc != 0) {
      int expected = D_REQUESTED;
      if (g_detach.compare_exchange_strong(expected, D_NONE)) g_unsubscribe(sub);
      snprintf(g_error, sizeof g_error, "cuptiEnableDomain(%d) returned %d", domain, rc);
      return -1;
    }
  }
  return 0;
}

// Where the detach stands: 0 none asked, 1 asked (no API exit yet), 2 finalizing, 3 done (then
// back to 0 for the next), or -(cuptiFinalize's error).
int fsdpr_cupti_detached() {
  int state = g_detach.load();
  if (state == D_DONE) g_detach.store(D_NONE);
  return state;
}

}  // extern "C"
