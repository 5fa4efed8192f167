#include "memory/shm_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace flashserve {
namespace {

// The handler reads the table without a lock (it may interrupt a thread holding one). A slot is
// filled end first, then begin, and emptied begin first: a handler that sees begin != 0 sees the
// end that goes with it. A slot is emptied only once no request uses its mapping, so no fault in
// it can race its reuse.
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[ShmFaultGuard::kMaxWatched];
std::atomic<int> g_used{0};  // slots [0, g_used) may be filled
std::mutex g_mu;             // Watch / Unwatch
uintptr_t g_page = 4096;
struct sigaction g_previous;

// Hands a SIGBUS that is not ours to whoever had it before.
void Chain(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
  } else if (info != nullptr && info->si_code > 0) {
    // Default action: returning re-runs the faulting access, which now kills the process as if
    // no handler had been installed (ignoring a fault would loop forever).
    signal(SIGBUS, SIG_DFL);
  } else {
    // Sent (kill -BUS): no access to re-run. The default action now, as without a handler -- not
    // a return with SIG_DFL left in place of the guard, which the next client that truncated its
    // region would then have found gone (the process killed).
    signal(SIGBUS, SIG_DFL);
    raise(SIGBUS);  // pending until this handler returns, then the default action
  }
}

// Async-signal-safe: atomics and mmap (a plain system call) only.
void OnSigbus(int sig, siginfo_t* info, void* context) {
  // si_code <= 0: sent by a process (kill), not a fault: si_addr means nothing.
  if (info != nullptr && info->si_code > 0) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    const int used = g_used.load(std::memory_order_acquire);
    for (int i = 0; i < used; ++i) {
      Slot& slot = g_slots[i];
      const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
      if (begin == 0 || addr < begin) continue;
      const uintptr_t end = slot.end.load(std::memory_order_acquire);
      if (addr >= end) continue;
      const uintptr_t page = addr & ~(g_page - 1);
      // Marked before the zero pages go in: a call reading them on another thread must find the
      // mapping faulted when it checks (else it could answer OK with zeros). Should the swap
      // fail, the default action ends the process anyway.
      slot.faulted.store(true, std::memory_order_release);
      // The rest of the mapping: its pages past the fault are past the object's end too (or
      // equally unbacked), and one replacement beats a signal per page.
      void* zero = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (zero == MAP_FAILED) break;  // cannot recover: the default action
      return;
    }
  }
  Chain(sig, info, context);
}

void InstallHandler() {
  g_page = uintptr_t(sysconf(_SC_PAGESIZE));
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
}

}  // namespace

int ShmFaultGuard::Watch(void* mapping, size_t bytes) {
  static std::once_flag installed;
  std::call_once(installed, InstallHandler);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(mapping);
  const uintptr_t end = (begin + bytes + g_page - 1) & ~(g_page - 1);
  std::lock_guard<std::mutex> lock(g_mu);
  int slot = 0;
  const int used = g_used.load(std::memory_order_relaxed);
  while (slot < used && g_slots[slot].begin.load(std::memory_order_relaxed) != 0) ++slot;
  if (slot == kMaxWatched) return -1;
  g_slots[slot].faulted.store(false, std::memory_order_relaxed);
  g_slots[slot].end.store(end, std::memory_order_release);
  g_slots[slot].begin.store(begin, std::memory_order_release);
  if (slot == used) g_used.store(used + 1, std::memory_order_release);
  return slot;
}

void ShmFaultGuard::Unwatch(int slot) {
  if (slot < 0 || slot >= kMaxWatched) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
}

bool ShmFaultGuard::Faulted(int slot) {
  return slot >= 0 && slot < kMaxWatched && g_slots[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace flashserve
