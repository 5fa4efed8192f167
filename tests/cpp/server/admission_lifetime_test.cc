// An Admission that outlives its AttentionRuntime. A DecodeStep's answer keeps its admission until
// gRPC drops the answer's slices, and nothing in gRPC's API promises that happens before the
// server destroys the runtime (whose destructor waits for its jobs, not for admissions).
//
// Before the fix the admission pointed at the runtime, and releasing it locked and decremented the
// runtime's freed memory. The test refills that memory with zeros (glibc hands the freed block
// straight back to the next allocation of its size) and checks that releasing the admission
// leaves it untouched. It runs in a child process (a death test asserting a clean exit) so that a
// corrupted heap, or a hang on a garbage lock, cannot take the rest of the binary with it.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"
#include "runtime_harness.h"

namespace flashserve {
namespace {

constexpr unsigned kChildSeconds = 30;  // a hang on a garbage lock ends here
constexpr int kRefills = 64;            // blocks of the runtime's size allocated after it is gone

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

// Exit code of the child: 0 when the admission's release wrote nothing into the memory the
// destroyed runtime gave back.
int ReleaseAdmissionAfterTheRuntime() {
  alarm(kChildSeconds);
  runtime_testing::Harness<IdleBackend> h(/*capacity=*/1);
  AttentionRuntime::Admission admission = h.runtime->Admit();
  if (!admission) return 2;
  h.runtime.reset();  // ~Server: the runtime goes while gRPC still holds an answer
  std::vector<std::unique_ptr<char[]>> refills;
  for (int i = 0; i < kRefills; ++i) {
    refills.emplace_back(new char[sizeof(AttentionRuntime)]);
    std::memset(refills.back().get(), 0, sizeof(AttentionRuntime));
  }
  admission = AttentionRuntime::Admission();  // the answer's slices are dropped
  const std::vector<char> zeros(sizeof(AttentionRuntime), 0);
  for (const auto& block : refills) {
    if (std::memcmp(block.get(), zeros.data(), zeros.size()) != 0) return 1;
  }
  return 0;
}

TEST(AdmissionLifetimeDeathTest, AdmissionReleasedAfterTheRuntimeIsDestroyed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(ReleaseAdmissionAfterTheRuntime()), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve
