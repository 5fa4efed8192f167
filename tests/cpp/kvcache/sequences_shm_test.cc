// A Sequences call's leases on clients' shared-memory regions are all given back before its
// answer (edge/sequences/sequences_shm.h): memory/shm_regions.h promises that a client that
// unregisters after its answer never finds its region in use.
#include "edge/sequences/sequences_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

// The call holds its region while it runs and ReleaseLeases gives it back. The lease used to be
// kept twice (a list of leases, and each whole region span): the local socket cleared only the
// list before writing its answer, so the region stayed in use until the answer was written and a
// client unregistering right after reading it could be refused FAILED_PRECONDITION "in use".
TEST(SequenceShmLeases, ReleaseLeasesGivesEveryRegionBack) {
  const std::string key = "/fs_seq_shm_test_" + std::to_string(getpid()) + "_" +
                          std::to_string(std::random_device{}());  // a crashed run's stays
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  ShmLimits limits;
  limits.allow = true;
  ShmRegistry registry(limits, nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", key, 0, 4096, "").ok());
  SequenceShm shm;
  InitSequenceShm(&registry, nullptr, &shm);
  v1::Tensor q;  // [1 row, 2 heads, 8] fp16 = 32 bytes at offset 64 of the region
  q.set_dtype(v1::FLOAT16);
  for (int64_t d : {1, 2, 8}) q.add_shape(d);
  q.mutable_shm()->set_region("r");
  q.mutable_shm()->set_offset(64);
  q.mutable_shm()->set_byte_size(32);
  ASSERT_TRUE(ShmRows(q, "q", &shm).ok());
  EXPECT_EQ(registry.Unregister(ShmType::kSystem, "r", "").code(),
            absl::StatusCode::kFailedPrecondition)
      << "a region a call uses must not go away under it";
  EXPECT_TRUE(shm.ReleaseLeases().ok());
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  shm_unlink(key.c_str());
}

}  // namespace
}  // namespace flashserve
