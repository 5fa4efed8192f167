// An Admission, and a Sequences call's CallHold, that outlive their AttentionRuntime. A
// DecodeStep's answer keeps its admission until gRPC drops the answer's slices, and nothing in
// gRPC's API promises that happens before the server destroys the runtime (whose destructor waits
// for its jobs, not for admissions).
//
// Before the fix the admission pointed at the runtime, and releasing it locked and decremented the
// runtime's freed memory. Each test runs in a child process (a death test asserting a clean exit)
// so that a corrupted heap, or a hang on a garbage lock, cannot take the rest of the binary with
// it.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "edge/sequences/sequences_hold.h"
#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"

namespace flashserve {
namespace {

constexpr unsigned kChildSeconds = 30;  // a hang on a garbage lock ends here

// Never runs a job: the test only admits.
class IdleBackend final : public Backend {
 public:
  IdleBackend() {
    caps_.name = "idle";
    caps_.dtypes = {kernels::DType::kFloat32};
    caps_.max_head_dim = 8;
  }
  const BackendCapabilities& capabilities() const override { return caps_; }
  absl::Status Run(const BackendJob&, PhaseTiming*, std::string*) override {
    return absl::InternalError("not expected to run");
  }

 private:
  BackendCapabilities caps_;
};

// A runtime in a buffer of the test's over an idle backend. The tests destroy it, zero the buffer
// and check that what outlived it writes nothing there: no reliance on the allocator handing a
// freed block back to the next allocation (it did not, for a block of this size, in session 24).
struct RuntimeInBuffer {
  explicit RuntimeInBuffer(int64_t max_inflight_bytes = 0) : scheduler(*Scheduler::Create({1, 1})) {
    ValidationLimits limits;
    limits.dtypes = backend.capabilities().dtypes;
    runtime = new (storage)
        AttentionRuntime(&backend, scheduler.get(), limits, nullptr, max_inflight_bytes);
  }
  // ~Server: the runtime goes while gRPC still holds an answer.
  void DestroyAndZero() {
    runtime->~AttentionRuntime();
    std::memset(storage, 0, sizeof(storage));
  }
  bool StillZero() const {
    for (unsigned char byte : storage)
      if (byte != 0) return false;
    return true;
  }
  IdleBackend backend;
  std::unique_ptr<Scheduler> scheduler;
  alignas(AttentionRuntime) unsigned char storage[sizeof(AttentionRuntime)];
  AttentionRuntime* runtime = nullptr;
};

// Exit code of the child: 0 when the admission's release wrote nothing into the memory the
// destroyed runtime occupied.
int ReleaseAdmissionAfterTheRuntime() {
  alarm(kChildSeconds);
  auto r = std::make_unique<RuntimeInBuffer>();
  AttentionRuntime::Admission admission = r->runtime->Admit();
  if (!admission) return 2;
  r->DestroyAndZero();
  admission = AttentionRuntime::Admission();  // the answer's slices are dropped
  return r->StillZero() ? 0 : 1;
}

TEST(AdmissionLifetimeDeathTest, AdmissionReleasedAfterTheRuntimeIsDestroyed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(ReleaseAdmissionAfterTheRuntime()), ::testing::ExitedWithCode(0), "");
}

// The same for the bytes a Sequences call holds (CallHold) until its answer is dropped. Before
// the fix the hold pointed at the runtime, and giving its bytes back decremented freed memory.
int ReleaseCallHoldAfterTheRuntime() {
  alarm(kChildSeconds);
  auto r = std::make_unique<RuntimeInBuffer>(/*max_inflight_bytes=*/1000);
  auto hold = std::make_unique<CallHold>();
  if (!hold->Reserve(r->runtime, 600).ok()) return 2;
  if (hold->Reserve(r->runtime, 600).ok()) return 3;  // over the limit: the count is live
  r->DestroyAndZero();
  hold.reset();  // the answer's slices are dropped
  return r->StillZero() ? 0 : 1;
}

TEST(AdmissionLifetimeDeathTest, CallHoldReleasedAfterTheRuntimeIsDestroyed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(ReleaseCallHoldAfterTheRuntime()), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve
