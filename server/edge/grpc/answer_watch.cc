#include "edge/grpc/answer_watch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <thread>
#include <utility>
#include <vector>

#include "grpcpp/server_context.h"
#include "spdlog/spdlog.h"

namespace flashserve {

// recursive: cancelling may run the call's OnDone on the watch's own thread (gRPC runs callbacks
// at the end of its calls), which forgets this entry while the watch still holds it.
struct AnswerWatch::Entry {
  std::recursive_mutex mu;
  grpc::ServerContextBase* context = nullptr;  // null once gRPC is done with the call
  std::chrono::steady_clock::time_point deadline;  // steady: a clock step cancels nothing
  bool cancelled = false;                          // guarded by the watch's mutex
  std::list<std::shared_ptr<Entry>>::iterator at;  // in State::entries
};

namespace {

struct State {
  std::mutex mu;  // before any Entry::mu, never after
  std::condition_variable wake;
  bool running = false, stopping = false;
  absl::Duration timeout;
  std::list<std::shared_ptr<AnswerWatch::Entry>> entries;  // oldest first
  std::thread thread;
  std::atomic<int64_t> cancelled{0};
};

State& state() {
  static State* s = new State();  // never destroyed: reactors may outlive static destruction
  return *s;
}

// The entries due now, marked cancelled (each is cancelled once).
std::vector<std::shared_ptr<AnswerWatch::Entry>> TakeDue(
    State& s, std::chrono::steady_clock::time_point now) {
  std::vector<std::shared_ptr<AnswerWatch::Entry>> due;
  for (const auto& entry : s.entries) {
    if (entry->deadline > now) break;  // deadlines grow with the list: the rest are later
    if (!entry->cancelled) due.push_back(entry);
    entry->cancelled = true;
  }
  return due;
}

void Loop() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  const auto every = absl::ToChronoNanoseconds(
      std::clamp(s.timeout / 4, absl::Milliseconds(10), absl::Milliseconds(250)));
  while (!s.stopping) {
    s.wake.wait_for(lock, every);
    const std::vector<std::shared_ptr<AnswerWatch::Entry>> due =
        TakeDue(s, std::chrono::steady_clock::now());
    if (due.empty()) continue;
    lock.unlock();  // OnDone forgets entries under s.mu
    int64_t dropped = 0;
    for (const auto& entry : due) {
      std::lock_guard<std::recursive_mutex> call(entry->mu);
      if (entry->context == nullptr) continue;
      entry->context->TryCancel();
      ++dropped;
    }
    if (dropped > 0) {
      s.cancelled.fetch_add(dropped);
      spdlog::warn(
          "gRPC: dropped {} answer(s) their clients had not taken {} s after they were ready "
          "(--answer_timeout_s): the calls are cancelled",
          dropped, absl::ToInt64Seconds(s.timeout));
    }
    lock.lock();
  }
}

}  // namespace

void AnswerWatch::Start(absl::Duration timeout) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.running || timeout <= absl::ZeroDuration()) return;
  s.running = true;
  s.stopping = false;
  s.timeout = timeout;
  s.thread = std::thread(Loop);
}

void AnswerWatch::Stop() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running) return;
    s.stopping = true;
  }
  s.wake.notify_all();
  s.thread.join();
  std::lock_guard<std::mutex> lock(s.mu);
  s.running = false;
}

AnswerWatch::Token AnswerWatch::Watch(grpc::ServerContextBase* context) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.running || s.stopping) return Token();
  auto entry = std::make_shared<Entry>();
  entry->context = context;
  entry->deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        absl::ToChronoNanoseconds(s.timeout));
  entry->at = s.entries.insert(s.entries.end(), entry);
  return Token(std::move(entry));
}

int64_t AnswerWatch::cancelled() { return state().cancelled.load(); }

AnswerWatch::Token& AnswerWatch::Token::operator=(Token&& other) noexcept {
  if (this != &other) {
    Forget();
    entry_ = std::move(other.entry_);
  }
  return *this;
}

void AnswerWatch::Token::Forget() {
  if (entry_ == nullptr) return;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.entries.erase(entry_->at);
  }
  // Kept past the guard: the entry (and its mutex) would be freed while still locked.
  const std::shared_ptr<Entry> entry = std::move(entry_);
  std::lock_guard<std::recursive_mutex> call(entry->mu);  // waits for a cancel in progress
  entry->context = nullptr;
}

}  // namespace flashserve
