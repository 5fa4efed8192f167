// ShmFaultGuard (memory/shm_fault_guard.h) through ShmRegistry: a client that cuts its shm object
// short while the server reads or writes its region fails the requests that used it, and no
// longer kills the server with SIGBUS.
#include "memory/shm_fault_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "memory/shm_regions.h"

namespace flashserve {
namespace {

constexpr size_t kPage = 4096;

// A shm object the "client" can resize; unlinked at the end of the test.
class ClientObject {
 public:
  explicit ClientObject(size_t bytes) {
    key_ = "/fs_fault_test_" + std::to_string(getpid()) + "_" + std::to_string(counter_++) + "_" +
           std::to_string(std::random_device{}());  // a crashed run's objects stay
    fd_ = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd_, 0);
    Resize(bytes);
  }
  ~ClientObject() {
    close(fd_);
    shm_unlink(key_.c_str());
  }
  void Resize(size_t bytes) { EXPECT_EQ(ftruncate(fd_, off_t(bytes)), 0); }
  void Unlink() { shm_unlink(key_.c_str()); }  // the object lives on while open or mapped
  const std::string& key() const { return key_; }
  int fd() const { return fd_; }

 private:
  static inline int counter_ = 0;
  std::string key_;
  int fd_ = -1;
};

ShmLimits Allowed() {
  ShmLimits limits;
  limits.allow = true;
  return limits;
}

char ReadByte(const char* p) { return *static_cast<const volatile char*>(p); }

TEST(ShmFaultGuard, AnObjectCutShortUnderALeaseFailsTheLeaseInsteadOfKillingTheServer) {
  ClientObject object(4 * kPage);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 4 * kPage, "").ok());
  absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 4 * kPage, "");
  ASSERT_TRUE(span.ok()) << span.status();
  span->data[5] = 'a';
  EXPECT_TRUE(ShmRegistry::CheckLease(span->lease).ok());

  object.Resize(kPage);  // the client cuts it short while a request holds the region
  EXPECT_EQ(ReadByte(span->data + 5), 'a');            // still the client's page
  EXPECT_EQ(ReadByte(span->data + 3 * kPage + 1), 0);  // past the end: SIGBUS without the guard
  span->data[2 * kPage + 7] = 'b';                     // and a write past the end
  EXPECT_EQ(ReadByte(span->data + 2 * kPage + 7), 'b');

  const absl::Status lease = ShmRegistry::CheckLease(span->lease);
  EXPECT_EQ(lease.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(lease.message().find("faulted"), std::string::npos) << lease;
  EXPECT_NE(lease.message().find("\"r\""), std::string::npos) << lease;
  // Refused from now on, even once the object is long enough again: the mapping is not the
  // client's memory any more.
  object.Resize(4 * kPage);
  EXPECT_EQ(registry.Lease("r", 0, 16, "").status().code(), absl::StatusCode::kFailedPrecondition);
  span = absl::UnknownError("lease given back");
  ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  // Registered again it is shared with the client as before.
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 4 * kPage, "").ok());
  span = registry.Lease("r", 0, 4 * kPage, "");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_TRUE(ShmRegistry::CheckLease(span->lease).ok());
  span->data[3 * kPage] = 'c';
  char seen = 0;
  ASSERT_EQ(pread(object.fd(), &seen, 1, off_t(3 * kPage)), 1);
  EXPECT_EQ(seen, 'c');
}

TEST(ShmFaultGuard, AnObjectThatShrankWithoutAFaultAlsoFailsTheLease) {
  // A page-locked region's device copies would not fault: the size is checked too.
  ClientObject object(2 * kPage);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), kPage, kPage, "").ok());
  absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 64, "");
  ASSERT_TRUE(span.ok());
  object.Resize(kPage + 10);
  const absl::Status lease = ShmRegistry::CheckLease(span->lease);
  EXPECT_EQ(lease.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(lease.message().find("shrank"), std::string::npos) << lease;
}

TEST(ShmFaultGuard, ThreadsCopyingFromARegionCutShortAllFinish) {
  ClientObject object(64 * kPage);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 64 * kPage, "").ok());
  absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 64 * kPage, "");
  ASSERT_TRUE(span.ok());
  std::atomic<bool> go{false};
  std::vector<std::thread> copiers;
  for (int t = 0; t < 4; ++t) {
    copiers.emplace_back([&, t] {
      std::vector<char> into(64 * kPage);
      while (!go.load()) std::this_thread::yield();
      for (int round = 0; round < 50; ++round) {
        std::memcpy(into.data(), span->data, into.size());  // reads
        std::memset(span->data + t * kPage, t + 1, kPage);  // and writes
      }
    });
  }
  go = true;
  object.Resize(3 * kPage);
  for (std::thread& t : copiers) t.join();
  EXPECT_FALSE(ShmRegistry::CheckLease(span->lease).ok());
}

TEST(ShmFaultGuard, ASlotGivenBackStartsUnfaulted) {
  ClientObject object(2 * kPage);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 2 * kPage, "").ok());
  {
    absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 2 * kPage, "");
    ASSERT_TRUE(span.ok());
    object.Resize(0);
    EXPECT_EQ(ReadByte(span->data + kPage), 0);
    EXPECT_FALSE(ShmRegistry::CheckLease(span->lease).ok());
  }
  ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  object.Resize(2 * kPage);
  for (int i = 0; i < 3; ++i) {  // likely the same slot again
    ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 2 * kPage, "").ok());
    absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 2 * kPage, "");
    ASSERT_TRUE(span.ok()) << span.status();
    EXPECT_TRUE(ShmRegistry::CheckLease(span->lease).ok());
    span = absl::UnknownError("given back");
    ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  }
}

// Ended by a SIGBUS: killed by it, or, under a sanitizer whose handler the guard chains to, by
// that handler's report and non-zero exit (3: the setup failed).
bool EndedBySigbus(int status) {
  if (WIFSIGNALED(status)) return WTERMSIG(status) == SIGBUS;
  return WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 3;
}

// The guard only answers for watched mappings: any other SIGBUS still ends the process.
TEST(ShmFaultGuardDeathTest, ASigbusOutsideEveryRegionStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ClientObject watched(kPage);
        ShmRegistry registry(Allowed(), nullptr);
        if (!registry.RegisterSystem("r", watched.key(), 0, kPage, "").ok()) _exit(3);
        ClientObject other(2 * kPage);
        char* mine = static_cast<char*>(
            mmap(nullptr, 2 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, other.fd(), 0));
        watched.Unlink();  // this process dies: nothing else would unlink them
        other.Unlink();
        other.Resize(0);
        ReadByte(mine + kPage);
        _exit(0);
      },
      EndedBySigbus, "");
}

}  // namespace
}  // namespace flashserve
