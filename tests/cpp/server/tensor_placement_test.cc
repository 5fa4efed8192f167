// Where a job's tensors go (runtime/tensor_placement.h) with a backend that reads and writes
// page-locked and device memory where they are, as the CUDA backend does: an input in device
// memory (a client's CUDA region) beside inputs that must be staged stays where it is -- a host
// copy of it faulted the whole server -- and an output in device memory must suit the kernels'
// stores (O 16-byte, LSE 4-byte aligned), else INVALID_ARGUMENT rather than a GPU fault. Here
// "device memory" is a page that no host access may touch (PROT_NONE).
#include "runtime/tensor_placement.h"

#include <sys/mman.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

class DeviceLikeBackend final : public Backend {
 public:
  const BackendCapabilities& capabilities() const override { return caps_; }
  absl::Status Run(const BackendJob&, PhaseTiming*, std::string*) override {
    return absl::UnimplementedError("placement only");
  }
  bool ReadsDirectly(const TensorBytes& t) const override {
    return t.kind == MemoryKind::kPageLocked || t.kind == MemoryKind::kDevice;
  }
  bool WritesDirectly(MemoryKind kind) const override {
    return kind == MemoryKind::kPageLocked || kind == MemoryKind::kDevice;
  }

 private:
  BackendCapabilities caps_;
};

// A page no host access may touch, standing for a client's GPU memory.
struct Untouchable {
  char* page =
      static_cast<char*>(mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ~Untouchable() { munmap(page, 4096); }
};

AttentionProblem Problem() {
  AttentionProblem p;
  p.batch = 1;
  p.seqlen_q = 3;
  p.seqlen_k = 5;
  p.heads_q = p.heads_kv = 2;
  p.head_dim = 8;
  p.return_lse = true;
  return p;  // fp16: q 96 bytes, k and v 160 bytes
}

TEST(TensorPlacement, AnInputInDeviceMemoryStaysWhereItIsWhenOthersAreStaged) {
  DeviceLikeBackend backend;
  Untouchable device;
  ASSERT_NE(device.page, MAP_FAILED);
  const AttentionProblem problem = Problem();
  const std::string k(size_t(problem.kv_bytes()), 'k'), v(size_t(problem.kv_bytes()), 'v');
  v1::AttentionResponse response;
  TensorPlacementRequest request;
  request.problem = &problem;
  request.inputs[0] =
      TensorBytes::Contiguous(MemoryKind::kDevice, device.page, size_t(problem.q_bytes()));
  request.inputs[0].device = 0;
  request.inputs[1] = TensorBytes::Contiguous(MemoryKind::kHeap, k.data(), k.size());
  request.inputs[2] = TensorBytes::Contiguous(MemoryKind::kHeap, v.data(), v.size());
  request.response = &response;
  absl::StatusOr<TensorPlacement> placed = PlaceTensors(std::move(request), backend, nullptr);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_TRUE(placed->inputs_copied);
  EXPECT_EQ(placed->tensors.q.kind, MemoryKind::kDevice);
  EXPECT_EQ(placed->tensors.q.data(), device.page);
  EXPECT_EQ(placed->tensors.q.device, 0);
  EXPECT_EQ(std::string(placed->tensors.k.data(), k.size()), k);  // staged copies
  EXPECT_EQ(std::string(placed->tensors.v.data(), v.size()), v);
  EXPECT_NE(placed->tensors.k.data(), k.data());
}

TEST(TensorPlacement, OutputsInDeviceMemoryMustSuitTheKernelsStores) {
  DeviceLikeBackend backend;
  Untouchable device;
  ASSERT_NE(device.page, MAP_FAILED);
  const AttentionProblem problem = Problem();
  const std::string q(size_t(problem.q_bytes()), 'q'), kv(size_t(problem.kv_bytes()), 'k');
  const struct {
    size_t o_at, lse_at;
    bool ok;
    const char* named;
  } cases[] = {{0, 1024, true, ""},
               {16, 1028, true, ""},
               {8, 1024, false, "O "},
               {0, 1026, false, "LSE"},
               {1, 1024, false, "O "}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "O at +" << c.o_at << ", LSE at +" << c.lse_at);
    v1::AttentionResponse response;
    TensorPlacementRequest request;
    request.problem = &problem;
    request.inputs[0] = TensorBytes::Contiguous(MemoryKind::kDevice, device.page + 2048, q.size());
    request.inputs[1] = TensorBytes::Contiguous(MemoryKind::kDevice, device.page + 2048, kv.size());
    request.inputs[2] = request.inputs[1];
    request.response = &response;
    request.regions[0] = {MemoryKind::kDevice, device.page + c.o_at, q.size(), 0};
    request.regions[1] = {MemoryKind::kDevice, device.page + c.lse_at, 4 * 6, 0};
    absl::StatusOr<TensorPlacement> placed = PlaceTensors(std::move(request), backend, nullptr);
    if (c.ok) {
      ASSERT_TRUE(placed.ok()) << placed.status();
      EXPECT_EQ(placed->tensors.o.data, device.page + c.o_at);
      EXPECT_EQ(placed->tensors.lse.data, device.page + c.lse_at);
    } else {
      EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument) << placed.status();
      EXPECT_NE(placed.status().message().find(c.named), std::string::npos) << placed.status();
    }
  }
}

}  // namespace
}  // namespace flashserve
