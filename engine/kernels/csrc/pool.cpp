// The thread pool behind every multithreaded kernel. Work is split into blocks handed out from
// one atomic counter (generation << 32 | next block); the caller claims blocks as well, so a
// worker that the OS has descheduled (a shared, busy machine) delays nothing but its own block.
// Idle workers spin briefly (decode issues kernels back to back), then sleep on a condvar.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXCHAT_PAUSE() _mm_pause()
#else
#define MLXCHAT_PAUSE() std::this_thread::yield()
#endif

namespace mlxchat {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The profile's counters (profile_start / profile_stop): wall ns and calls per part, and the
// pool's dispatches.
int64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Profile {
  std::atomic<bool> on{false};
  std::atomic<int64_t> ns[int(Part::Count)], cpu_ns[int(Part::Count)], calls[int(Part::Count)];
  std::atomic<int64_t> dispatches{0}, dispatch_ns{0}, blocks{0}, caller_blocks{0}, tail_ns{0},
      wakeups{0}, serial{0};
  void reset() {
    for (int i = 0; i < int(Part::Count); ++i) ns[i] = cpu_ns[i] = calls[i] = 0;
    dispatches = dispatch_ns = blocks = caller_blocks = tail_ns = wakeups = serial = 0;
  }
};
Profile g_prof;

// How long an idle worker spins for the next dispatch before it sleeps (set_spin_us).
std::atomic<int> g_spin_us{100};

struct Slot {
  std::atomic<int64_t> nblocks{0};
  std::atomic<const std::function<void(int64_t)>*> fn{nullptr};
  std::atomic<int64_t> done{0};
};

class Pool {
 public:
  explicit Pool(int n) : nthreads_(n) {
    for (int i = 1; i < n; ++i) {
      std::thread([this] { worker(); }).detach();
    }
  }

  int size() const { return nthreads_; }

  void run(int64_t nblocks, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || nthreads_ <= 1 || nblocks <= 1) {
      for (int64_t i = 0; i < nblocks; ++i) fn(i);  // another stream holds the pool
      if (g_prof.on.load(std::memory_order_relaxed)) g_prof.serial.fetch_add(1);
      return;
    }
    const bool prof = g_prof.on.load(std::memory_order_relaxed);
    const int64_t t0 = prof ? now_ns() : 0;
    const uint32_t g = ++gen_;
    Slot& slot = slots_[g & 3];
    slot.nblocks.store(nblocks, std::memory_order_relaxed);
    slot.fn.store(&fn, std::memory_order_relaxed);
    slot.done.store(0, std::memory_order_relaxed);
    state_.store(uint64_t(g) << 32, std::memory_order_seq_cst);
    const bool asleep = sleepers_.load(std::memory_order_seq_cst) > 0;
    if (asleep) {
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_.notify_all();
    }
    int64_t mine = 0;
    while (claim(g)) ++mine;
    const int64_t t1 = prof ? now_ns() : 0;
    for (int spins = 0; slot.done.load(std::memory_order_acquire) < nblocks; ++spins) {
      if (spins < 4096) MLXCHAT_PAUSE(); else std::this_thread::yield();
    }
    if (prof) {
      const int64_t t2 = now_ns();
      g_prof.dispatches.fetch_add(1);
      g_prof.dispatch_ns.fetch_add(t2 - t0);
      g_prof.tail_ns.fetch_add(t2 - t1);
      g_prof.blocks.fetch_add(nblocks);
      g_prof.caller_blocks.fetch_add(mine);
      if (asleep) g_prof.wakeups.fetch_add(1);
    }
  }

 private:
  bool claim(uint32_t g) {
    uint64_t st = state_.load(std::memory_order_acquire);
    for (;;) {
      if (uint32_t(st >> 32) != g) return false;
      Slot& slot = slots_[g & 3];
      const int64_t nb = slot.nblocks.load(std::memory_order_relaxed);
      const auto* fn = slot.fn.load(std::memory_order_relaxed);
      const uint32_t idx = uint32_t(st);
      if (int64_t(idx) >= nb) return false;
      if (state_.compare_exchange_weak(st, st + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        (*fn)(idx);
        slot.done.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }

  void worker() {
    uint32_t seen = 0;
    for (;;) {
      const uint32_t g = uint32_t(state_.load(std::memory_order_acquire) >> 32);
      if (g != seen) {
        while (claim(g)) {
        }
        seen = g;
        continue;
      }
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
      bool woke = false;
      for (int i = 0; !woke; ++i) {
        for (int j = 0; j < 64; ++j) MLXCHAT_PAUSE();
        woke = uint32_t(state_.load(std::memory_order_acquire) >> 32) != seen;
        if (!woke && std::chrono::steady_clock::now() > until) break;
      }
      if (woke) continue;
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, [&] { return uint32_t(state_.load(std::memory_order_seq_cst) >> 32) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const int nthreads_;
  std::mutex run_mu_;
  uint32_t gen_ = 0;
  Slot slots_[4];
  std::atomic<uint64_t> state_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

std::mutex g_mu;
int g_threads = 1;
Pool* g_pool = nullptr;  // never destroyed: its detached workers live as long as the process

std::atomic<bool> g_interleave{true};
std::atomic<int64_t> g_prefetch{1024};

const char* const kPartNames[] = {"norm", "q/k/v", "rope", "attention", "o", "gate/up", "swiglu",
                                  "down", "residual", "product (other)", "dequantize",
                                  "kv-cache write"};
static_assert(sizeof(kPartNames) / sizeof(kPartNames[0]) == int(Part::Count));

}  // namespace

int spin_us() { return g_spin_us.load(std::memory_order_relaxed); }
void set_spin_us(int us) { g_spin_us.store(std::max(0, us), std::memory_order_relaxed); }

bool profiling() { return g_prof.on.load(std::memory_order_relaxed); }

void profile_add(Part p, int64_t ns, int64_t cpu_ns) {
  g_prof.ns[int(p)].fetch_add(ns, std::memory_order_relaxed);
  g_prof.cpu_ns[int(p)].fetch_add(cpu_ns, std::memory_order_relaxed);
  g_prof.calls[int(p)].fetch_add(1, std::memory_order_relaxed);
}

ScopedPart::ScopedPart(Part part)
    : p(part), t0(profiling() ? now_ns() : -1), c0(t0 >= 0 ? thread_cpu_ns() : 0) {}
ScopedPart::~ScopedPart() {
  if (t0 >= 0) profile_add(p, now_ns() - t0, thread_cpu_ns() - c0);
}

void profile_start() {
  g_prof.reset();
  g_prof.on.store(true);
}

ProfileRows profile_stop() {
  g_prof.on.store(false);
  ProfileRows out;
  const auto row = [&](const char* name, int64_t a, int64_t b, int64_t c) {
    out.push_back({name, {a, b, c}});
  };
  for (int i = 0; i < int(Part::Count); ++i)
    if (g_prof.calls[i]) row(kPartNames[i], g_prof.calls[i], g_prof.ns[i], g_prof.cpu_ns[i]);
  row("pool: dispatches", g_prof.dispatches, g_prof.dispatch_ns, 0);
  row("pool: caller's wait for the other threads", g_prof.dispatches, g_prof.tail_ns, 0);
  row("pool: blocks (all, the caller's)", g_prof.blocks, g_prof.caller_blocks, 0);
  row("pool: dispatches that woke a sleeping thread", g_prof.wakeups, 0, 0);
  row("pool: serial runs (one block, or the pool busy)", g_prof.serial, 0, 0);
  return out;
}

bool interleave_rows() { return g_interleave.load(std::memory_order_relaxed); }
void set_interleave_rows(bool on) { g_interleave.store(on, std::memory_order_relaxed); }
int64_t prefetch_bytes() { return g_prefetch.load(std::memory_order_relaxed); }
void set_prefetch_bytes(int64_t n) { g_prefetch.store(std::max<int64_t>(0, n), std::memory_order_relaxed); }

int num_threads() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_threads;
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_threads = n < 1 ? 1 : n;
  if (g_pool && g_pool->size() != g_threads) g_pool = nullptr;  // the old pool's workers idle on
}

void parallel_for(int64_t nblocks, const std::function<void(int64_t)>& fn) {
  Pool* pool;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (!g_pool) g_pool = new Pool(g_threads);
    pool = g_pool;
  }
  pool->run(nblocks, fn);
}

}  // namespace mlxchat
