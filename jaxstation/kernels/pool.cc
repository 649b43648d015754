// The kernels' own worker threads (declared in cpu_kernels.h): one pool for the whole library, whose workers spin for
// a bounded time after each job before they sleep, so that the next kernel call of a step finds them awake.

#include <immintrin.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "cpu_kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t> spin_ns{0};  // how long a worker spins after a job; 0: the pool is off, XLA's pool runs the items

struct Pool {
  std::atomic<bool> busy{false};     // held by the one caller whose job the workers run
  std::atomic<uint64_t> epoch{0};    // bumped for every job: what a spinning or sleeping worker waits for
  std::atomic<int64_t> seats{0};     // helpers the open job still takes; the caller closes it (0) after its own run
  std::atomic<int64_t> left{0};      // helpers that took a seat and are done with the job
  std::atomic<void (*)(void*)> job{nullptr};
  std::atomic<void*> arg{nullptr};
  std::atomic<int64_t> sleepers{0};  // workers asleep on `wake`, or about to be
  std::mutex mu;
  std::condition_variable wake;
  int64_t workers = 0;  // grown by the caller holding `busy`
};

std::atomic<Pool*> the_pool{nullptr};

// Waits for a job after `seen`: spins (a pause a probe, yielding the core every few microseconds) for spin_ns, then
// sleeps.
void Await(Pool* p, uint64_t seen) {
  const int64_t budget = spin_ns.load(std::memory_order_relaxed);
  const Clock::time_point start = Clock::now();
  for (int64_t k = 1; budget > 0; ++k) {
    if (p->epoch.load(std::memory_order_acquire) != seen) return;
    _mm_pause();
    if (k % 32 == 0) {
      if (Clock::now() - start > std::chrono::nanoseconds(budget)) break;
      if (k % 256 == 0) std::this_thread::yield();  // a thread waiting for this core gets it
    }
  }
  std::unique_lock<std::mutex> lock(p->mu);
  p->sleepers.fetch_add(1);
  p->wake.wait(lock, [&] { return p->epoch.load() != seen; });
  p->sleepers.fetch_sub(1);
}

void Work(Pool* p, uint64_t seen) {
  sigset_t all;  // signals go to the process's own threads, never to a worker
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) {
    Await(p, seen);
    seen = p->epoch.load(std::memory_order_acquire);
    // A seat binds the caller to wait for this worker: without one the worker touches nothing of the job.
    int64_t s = p->seats.load(std::memory_order_acquire);
    while (s > 0 && !p->seats.compare_exchange_weak(s, s - 1, std::memory_order_acq_rel)) {
    }
    if (s <= 0) continue;
    p->job.load(std::memory_order_relaxed)(p->arg.load(std::memory_order_relaxed));
    p->left.fetch_add(1, std::memory_order_release);
  }
}

// A forked child has none of the parent's workers (and maybe a held lock): it starts a pool of its own.
void ForgetPool() { the_pool.store(nullptr); }

Pool* GetPool() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, ForgetPool); });
  Pool* p = the_pool.load(std::memory_order_acquire);
  if (p) return p;
  Pool* fresh = new Pool;  // never freed: workers may outlive every static, and the process exits around them
  if (the_pool.compare_exchange_strong(p, fresh)) return fresh;
  delete fresh;
  return p;
}

}  // namespace

namespace jaxstation {

bool RunOnWorkers(int64_t helpers, void (*job)(void*), void* arg) {
  if (spin_ns.load(std::memory_order_relaxed) <= 0) return false;
  Pool* p = GetPool();
  bool idle = false;
  if (!p->busy.compare_exchange_strong(idle, true, std::memory_order_acquire)) return false;
  const uint64_t seen = p->epoch.load(std::memory_order_relaxed);
  for (; p->workers < std::min<int64_t>(helpers, 256); ++p->workers) std::thread(Work, p, seen).detach();
  p->job.store(job, std::memory_order_relaxed);
  p->arg.store(arg, std::memory_order_relaxed);
  p->left.store(0, std::memory_order_relaxed);
  p->seats.store(helpers, std::memory_order_release);
  p->epoch.fetch_add(1);
  if (p->sleepers.load() > 0) {
    { std::lock_guard<std::mutex> lock(p->mu); }
    p->wake.notify_all();
  }
  job(arg);
  const int64_t taken = helpers - p->seats.exchange(0, std::memory_order_acq_rel);
  while (p->left.load(std::memory_order_acquire) < taken) std::this_thread::yield();
  p->busy.store(false, std::memory_order_release);
  return true;
}

}  // namespace jaxstation

extern "C" void jaxstation_kernel_spin(int64_t us) { spin_ns.store(std::max<int64_t>(us, 0) * 1000); }
