// ShmRegistry: the safety rules of clients' shared-memory regions (memory/shm_regions.h), on real
// POSIX shared-memory objects, and a fake ShmDeviceAccess for the GPU side.
#include "memory/shm_regions.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

// A shm object of `bytes`, unlinked at the end of the test.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes) {
    key_ = "/fs_shm_test_" + std::to_string(getpid()) + "_" + std::to_string(counter_++) + "_" +
           std::to_string(std::random_device{}());  // a crashed run's objects stay
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, off_t(bytes)), 0);
    data_ = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    bytes_ = bytes;
    close(fd);
  }
  ~ShmObject() {
    munmap(data_, bytes_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  char* data() { return data_; }

 private:
  static inline int counter_ = 0;
  std::string key_;
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

ShmLimits Allowed() {
  ShmLimits limits;
  limits.allow = true;
  return limits;
}

TEST(ShmRegistry, OffByDefault) {
  ShmObject object(4096);
  ShmRegistry registry(ShmLimits{}, nullptr);
  const absl::Status s = registry.RegisterSystem("r", object.key(), 0, 4096, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("--allow_client_shm"), std::string::npos) << s;
  EXPECT_EQ(registry.Lease("r", 0, 1, "").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry.region_count(), 0);
}

TEST(ShmRegistry, MapsTheObjectAtItsOffsetAndSharesIt) {
  ShmObject object(3 * 4096);
  ShmRegistry registry(Allowed(), nullptr);
  // An offset that is not page aligned: the mapping must start at the right byte anyway.
  ASSERT_TRUE(registry.RegisterSystem("in", object.key(), 4096 + 100, 5000, "").ok());
  absl::StatusOr<ShmSpan> span = registry.Lease("in", 8, 16, "");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->kind, MemoryKind::kHeap);  // no device access: pageable
  std::memcpy(object.data() + 4096 + 100 + 8, "client wrote it", 16);
  EXPECT_EQ(std::string(span->data, 15), "client wrote it");
  std::memcpy(span->data, "server wrote it", 16);
  EXPECT_EQ(std::string(object.data() + 4096 + 108, 15), "server wrote it");
  EXPECT_EQ(registry.region_count(), 1);
  EXPECT_EQ(registry.region_bytes(), 5000);
  auto status = registry.Status(ShmType::kSystem, "", "");
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->size(), 1u);
  EXPECT_EQ((*status)[0].key, object.key());
  EXPECT_EQ((*status)[0].offset, 4096u + 100);
}

TEST(ShmRegistry, NamesAndKeysAreValidated) {
  ShmRegistry registry(Allowed(), nullptr);
  for (const char* bad : {"", "a/b", "../x", "sp ace", "q\n"}) {
    EXPECT_EQ(registry.RegisterSystem(bad, "/k", 0, 1, "").code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_FALSE(CheckRegionName(std::string(129, 'a')).ok());
  for (const char* bad : {"", "/", "//x", "/a/b", "/../etc", "/..", "x y"}) {
    EXPECT_EQ(CheckShmKey(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(CheckShmKey("/input_simple").ok());
  EXPECT_TRUE(CheckShmKey("no_slash.1-2").ok());
}

TEST(ShmRegistry, MissingKeyAndTooSmallObjectAreClearErrors) {
  ShmRegistry registry(Allowed(), nullptr);
  absl::Status s = registry.RegisterSystem("r", "/fs_shm_test_does_not_exist", 0, 64, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("does not exist"), std::string::npos) << s;
  ShmObject object(4096);
  EXPECT_EQ(registry.RegisterSystem("r", object.key(), 0, 4097, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("r", object.key(), 4000, 97, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("r", object.key(), std::numeric_limits<uint64_t>::max(), 2,
                                    "")
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("r", object.key(), 0, 0, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.region_count(), 0);
}

// What a key names that is not an object is refused as such (INVALID_ARGUMENT), not as a
// permission the client lacks (it was PERMISSION_DENIED, "Invalid argument", for a directory).
TEST(ShmRegistry, KeysThatAreNoObjectAreInvalidNotForbidden) {
  const std::string dir = "fs_shm_test_dir_" + std::to_string(getpid());
  const std::string link = "fs_shm_test_link_" + std::to_string(getpid());
  ASSERT_EQ(mkdir(("/dev/shm/" + dir).c_str(), 0700), 0);
  ASSERT_EQ(symlink("/etc/hostname", ("/dev/shm/" + link).c_str()), 0);
  ShmRegistry registry(Allowed(), nullptr);
  for (const std::string& key : {dir, link}) {
    const absl::Status s = registry.RegisterSystem("r", "/" + key, 0, 64, "");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key << ": " << s;
    EXPECT_NE(s.message().find("is not a shared-memory object"), std::string::npos) << s;
  }
  rmdir(("/dev/shm/" + dir).c_str());
  unlink(("/dev/shm/" + link).c_str());
  EXPECT_EQ(registry.region_count(), 0);
}

// An object another process holds a lease on: opening it for writing waits until the lease is
// broken (45 s by default), and a few such registrations held every gRPC thread. Refused at once.
TEST(ShmRegistry, ALeasedObjectIsRefusedWithoutWaiting) {
  const std::string key = "/fs_shm_test_lease_" + std::to_string(getpid());
  const int created = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(created, 0);
  ASSERT_EQ(ftruncate(created, 4096), 0);
  close(created);  // a lease needs no writer open
  const int reader = shm_open(key.c_str(), O_RDONLY, 0);
  ASSERT_GE(reader, 0);
  signal(SIGIO, SIG_IGN);  // the lease break notifies the holder: this process
  if (fcntl(reader, F_SETLEASE, F_RDLCK) != 0) {
    close(reader);
    shm_unlink(key.c_str());
    GTEST_SKIP() << "cannot take a lease: " << std::strerror(errno);
  }
  ShmRegistry registry(Allowed(), nullptr);
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = registry.RegisterSystem("r", key, 0, 64, "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("lease"), std::string::npos) << s;
  fcntl(reader, F_SETLEASE, F_UNLCK);
  close(reader);
  EXPECT_TRUE(registry.RegisterSystem("r", key, 0, 64, "").ok()) << "and served once released";
  shm_unlink(key.c_str());
}

TEST(ShmRegistry, LeasesAreCheckedAgainstTheRegionWithoutOverflow) {
  ShmObject object(4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 1000, "").ok());
  EXPECT_TRUE(registry.Lease("r", 0, 1000, "").ok());
  EXPECT_TRUE(registry.Lease("r", 1000, 0, "").ok());
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (auto [offset, bytes] : {std::pair<uint64_t, uint64_t>{0, 1001}, {1, 1000}, {1001, 0},
                               {max, 2}, {2, max}, {max, max}}) {
    EXPECT_EQ(registry.Lease("r", offset, bytes, "").status().code(),
              absl::StatusCode::kInvalidArgument)
        << offset << " + " << bytes;
  }
  EXPECT_EQ(registry.Lease("nope", 0, 1, "").status().code(), absl::StatusCode::kNotFound);
}

// Objects of other users are refused unless --shm_any_uid: a server running as root was told
// to map another user's 0400 object, and read and wrote it for the client.
TEST(ShmRegistry, ObjectsOfOtherUsersAreRefusedUnlessAllowed) {
  ShmObject object(4096);
  const std::string path = "/dev/shm" + object.key();
  if (chown(path.c_str(), 65534, 65534) != 0) GTEST_SKIP() << "cannot chown (not root)";
  ShmRegistry strict(Allowed(), nullptr);
  const absl::Status refused = strict.RegisterSystem("r", object.key(), 0, 4096, "");
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("belongs to uid 65534"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("--shm_any_uid"), std::string::npos) << refused;
  ShmLimits any = Allowed();
  any.any_uid = true;
  ShmRegistry lenient(any, nullptr);
  EXPECT_TRUE(lenient.RegisterSystem("r", object.key(), 0, 4096, "").ok());
}

TEST(ShmRegistry, KeysOutsideTheConfiguredPrefixAreRefused) {
  ShmObject object(4096);  // "/fs_shm_test_..."
  ShmLimits limits = Allowed();
  limits.key_prefix = "fs_shm_test_";
  ShmRegistry registry(limits, nullptr);
  EXPECT_TRUE(registry.RegisterSystem("ok", object.key(), 0, 4096, "").ok());
  EXPECT_TRUE(registry.RegisterSystem("ok2", object.key().substr(1), 0, 4096, "").ok());
  limits.key_prefix = "flashserve_";
  ShmRegistry narrow(limits, nullptr);
  const absl::Status s = narrow.RegisterSystem("r", object.key(), 0, 4096, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("'/flashserve_'"), std::string::npos) << s;
}

// A name no registration would accept is not quoted back: an 8 MiB name made an 8 MiB 404.
TEST(ShmRegistry, UnknownNamesAreQuotedOnlyWhenTheyCouldBeNames) {
  ShmRegistry registry(Allowed(), nullptr);
  const std::string huge(8 << 20, 'Z');
  for (const absl::Status& s : {registry.Lease(huge, 0, 1, "").status(),
                                registry.Status(ShmType::kSystem, huge, "").status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    EXPECT_LT(s.message().size(), 200u);
    EXPECT_NE(s.message().find("8388608 bytes"), std::string::npos) << s;
  }
  const absl::Status odd = registry.Lease("a/b", 0, 1, "").status();
  EXPECT_EQ(odd.message().find("a/b"), std::string::npos) << odd;
  EXPECT_NE(registry.Lease("nope", 0, 1, "").status().message().find("\"nope\""), std::string::npos);
}

TEST(ShmRegistry, SubSpansOfAWholeLeaseAreCheckedAndKeepItInUse) {
  ShmObject object(4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 8, 1000, "").ok());
  absl::StatusOr<ShmSpan> whole = registry.LeaseWhole("r", "");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->bytes, 1000u);
  absl::StatusOr<ShmSpan> part = ShmRegistry::SubSpan(*whole, "r", 100, 50);
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(part->data, whole->data + 100);
  EXPECT_EQ(part->bytes, 50u);
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (auto [offset, bytes] : {std::pair<uint64_t, uint64_t>{0, 1001}, {1001, 0}, {max, 2}}) {
    EXPECT_EQ(ShmRegistry::SubSpan(*whole, "r", offset, bytes).status().code(),
              absl::StatusCode::kInvalidArgument)
        << offset << " + " << bytes;
  }
  whole->lease.reset();  // the sub-span still holds the region
  EXPECT_EQ(registry.Unregister(ShmType::kSystem, "r", "").code(),
            absl::StatusCode::kFailedPrecondition);
  part->lease.reset();
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  EXPECT_EQ(registry.LeaseWhole("r", "").status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmRegistry, ARegionInUseCannotBeUnregistered) {
  ShmObject object(4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 4096, "").ok());
  absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 16, "");
  ASSERT_TRUE(span.ok());
  ShmSpan copy = *span;
  span->lease.reset();
  absl::Status s = registry.Unregister(ShmType::kSystem, "r", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("in use by requests in flight (1 tensor"), std::string::npos) << s;
  EXPECT_EQ(registry.Unregister(ShmType::kSystem, "", "").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.region_count(), 1);
  copy.data[0] = 'x';  // still mapped
  copy.lease.reset();
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
  EXPECT_EQ(registry.region_count(), 0);
  EXPECT_EQ(registry.region_bytes(), 0);
  // Gone already: nothing to do, as Triton answers (cleanup code unregisters unconditionally).
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "r", "").ok());
}

TEST(ShmRegistry, AnObjectThatShrankIsRefusedNotTouched) {
  ShmObject object(8192);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 4096, 4096, "").ok());
  ASSERT_TRUE(registry.Lease("r", 0, 16, "").ok());
  const int fd = shm_open(object.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096 + 100), 0);  // the client shrinks it under the region
  close(fd);
  absl::StatusOr<ShmSpan> span = registry.Lease("r", 0, 16, "");
  EXPECT_EQ(span.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(span.status().message().find("shrank"), std::string::npos) << span.status();
}

TEST(ShmRegistry, LimitsOnCountAndBytes) {
  ShmObject object(4096);
  ShmLimits limits = Allowed();
  limits.max_regions = 2;
  limits.max_bytes = 5000;
  ShmRegistry registry(limits, nullptr);
  ASSERT_TRUE(registry.RegisterSystem("a", object.key(), 0, 4000, "").ok());
  absl::Status s = registry.RegisterSystem("b", object.key(), 0, 1001, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--shm_max_bytes"), std::string::npos) << s;
  // A size no unregistering could make room for is the client's error (HTTP 400), not a
  // RESOURCE_EXHAUSTED that HTTP answers 503, "retry later", forever.
  s = registry.RegisterSystem("b", object.key(), 0, ~uint64_t{0}, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("--shm_max_bytes=5000"), std::string::npos) << s;
  ASSERT_TRUE(registry.RegisterSystem("b", object.key(), 0, 1000, "").ok());
  s = registry.RegisterSystem("c", object.key(), 0, 1, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--shm_max_regions"), std::string::npos) << s;
  EXPECT_EQ(registry.RegisterSystem("a", object.key(), 0, 1, "").code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "", "").ok());  // all of them
  EXPECT_TRUE(registry.RegisterSystem("c", object.key(), 0, 4096, "").ok());
}

TEST(ShmRegistry, ARegionBelongsToItsOwner) {
  ShmObject object(4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 4096, "token-a").ok());
  EXPECT_EQ(registry.Lease("r", 0, 1, "token-b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "r", "token-b").ok());  // not its own: stays
  EXPECT_EQ(registry.region_count(), 1);
  EXPECT_TRUE(registry.Status(ShmType::kSystem, "", "token-b")->empty());
  EXPECT_TRUE(registry.Unregister(ShmType::kSystem, "", "token-b").ok());  // none of its own
  EXPECT_EQ(registry.region_count(), 1);
  EXPECT_TRUE(registry.Lease("r", 0, 1, "token-a").ok());
}

TEST(ShmRegistry, TwoNamesForOneObjectGiveSpansOfTheSameMemory) {
  ShmObject object(3 * 4096), other(3 * 4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("a", object.key(), 0, 3 * 4096, "").ok());
  ASSERT_TRUE(registry.RegisterSystem("b", object.key(), 4096 + 100, 4096, "").ok());
  ASSERT_TRUE(registry.RegisterSystem("c", other.key(), 0, 3 * 4096, "").ok());
  absl::StatusOr<ShmSpan> a = registry.Lease("a", 4096 + 108, 16, "");
  absl::StatusOr<ShmSpan> b = registry.Lease("b", 8, 16, "");
  absl::StatusOr<ShmSpan> c = registry.Lease("c", 4096 + 108, 16, "");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(a->data, b->data);  // mapped once per registration
  EXPECT_TRUE(a->memory == b->memory);
  EXPECT_EQ(a->position, 4096u + 108);
  EXPECT_EQ(b->position, a->position);  // counted from the object's start, not the region's
  EXPECT_FALSE(a->memory == c->memory);
  absl::StatusOr<ShmSpan> whole = registry.LeaseWhole("b", "");
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(ShmRegistry::SubSpan(*whole, "b", 8, 16)->position, b->position);
}

TEST(ShmOverlaps, AnOutputMayShareNoByteWithAnotherTensorUnderAnyName) {
  ShmObject object(2 * 4096), other(2 * 4096);
  ShmRegistry registry(Allowed(), nullptr);
  ASSERT_TRUE(registry.RegisterSystem("r", object.key(), 0, 2 * 4096, "").ok());
  ASSERT_TRUE(registry.RegisterSystem("alias", object.key(), 1000, 4096, "").ok());
  ASSERT_TRUE(registry.RegisterSystem("other", other.key(), 0, 2 * 4096, "").ok());
  auto span = [&](const char* name, uint64_t offset, uint64_t bytes) {
    absl::StatusOr<ShmSpan> s = registry.Lease(name, offset, bytes, "");
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  };
  struct Case {
    const char* what;
    std::vector<const char*> names;
    std::vector<uint64_t> offsets, bytes;
    std::vector<bool> outputs;
    const char* refused;  // null: accepted; else words of the message
  };
  const std::vector<Case> cases = {
      {"adjacent", {"r", "r", "r"}, {0, 100, 200}, {100, 100, 50}, {false, false, true}, nullptr},
      {"inputs overlap",
       {"r", "r", "r"},
       {0, 50, 200},
       {100, 100, 50},
       {false, false, true},
       nullptr},
      {"other object", {"r", "other"}, {0, 0}, {100, 100}, {false, true}, nullptr},
      {"empty output", {"r", "r"}, {0, 50}, {100, 0}, {false, true}, nullptr},
      {"output over an input",
       {"r", "r", "r"},
       {0, 100, 150},
       {100, 100, 8},
       {false, false, true},
       "out2 (region \"r\", offset 150, 8 bytes) overlaps in1"},
      {"input over an output", {"r", "r"}, {96, 0}, {8, 100}, {false, true}, "out1"},
      {"output over output", {"r", "r"}, {0, 99}, {100, 10}, {true, true}, "overlaps"},
      // A long input ending last: the short one after it must not hide it.
      {"inside a wide input",
       {"r", "r", "r"},
       {0, 10, 50},
       {1000, 10, 10},
       {false, false, true},
       "overlaps in0"},
      {"alias",
       {"r", "alias"},
       {1000 + 500, 504},
       {16, 8},
       {false, true},
       "out1 (region \"alias\", offset 504, 8 bytes) overlaps in0 (region \"r\", offset 1500, "
       "16 bytes) (the two regions are the same shared memory)"},
      {"alias adjacent", {"r", "alias"}, {1000 + 500, 516}, {16, 8}, {false, true}, nullptr},
  };
  static const char* kTensors[2][3] = {{"in0", "in1", "in2"}, {"out0", "out1", "out2"}};
  for (const Case& c : cases) {
    std::vector<ShmUse> uses;
    for (size_t i = 0; i < c.names.size(); ++i) {
      uses.push_back(UseOf(span(c.names[i], c.offsets[i], c.bytes[i]), kTensors[c.outputs[i]][i],
                           c.names[i], c.offsets[i], c.outputs[i]));
    }
    const absl::Status s = CheckShmOverlaps(uses);
    if (c.refused == nullptr) {
      EXPECT_TRUE(s.ok()) << c.what << ": " << s;
      continue;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.refused), std::string::npos) << c.what << ": " << s;
  }
}

// The GPU side, faked: what the registry asks of it and when.
class FakeDevice : public ShmDeviceAccess {
 public:
  bool PinHost(void*, size_t) override { return ++pinned, true; }
  void UnpinHost(void*) override { --pinned; }
  absl::StatusOr<void*> OpenIpc(absl::string_view handle, int device, size_t) override {
    if (handle.size() != 64) return absl::InvalidArgumentError("raw_handle: not an IPC handle");
    if (device != 0) return absl::InvalidArgumentError("device_id: no such device");
    ++opened;
    return static_cast<void*>(memory);
  }
  void CloseIpc(void* base, int) override {
    EXPECT_EQ(base, memory);
    --opened;
  }
  int pinned = 0, opened = 0;
  char memory[256] = {};
};

TEST(ShmRegistry, SystemRegionsArePinnedOnceAndCudaRegionsOpenedOnce) {
  ShmObject object(4096);
  FakeDevice device;
  ShmRegistry registry(Allowed(), &device);
  ASSERT_TRUE(registry.RegisterSystem("s", object.key(), 0, 4096, "").ok());
  EXPECT_EQ(device.pinned, 1);
  EXPECT_EQ(registry.Lease("s", 0, 8, "")->kind, MemoryKind::kPageLocked);
  EXPECT_EQ(registry.RegisterCuda("c", std::string(63, 'h'), 0, 256, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda("c", std::string(64, 'h'), 1, 256, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda("c", std::string(64, 'h'), -1, 256, "").code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.RegisterCuda("c", std::string(64, 'h'), 0, 256, "").ok());
  EXPECT_EQ(device.opened, 1);
  absl::StatusOr<ShmSpan> span = registry.Lease("c", 16, 32, "");
  ASSERT_TRUE(span.ok());
  EXPECT_EQ(span->kind, MemoryKind::kDevice);
  EXPECT_EQ(span->data, device.memory + 16);
  EXPECT_EQ(span->AsInput().device, 0);
  EXPECT_EQ(registry.Unregister(ShmType::kSystem, "c", "").code(),
            absl::StatusCode::kInvalidArgument);  // wrong type named
  span->lease.reset();
  ASSERT_TRUE(registry.Unregister(ShmType::kCuda, "", "").ok());
  EXPECT_EQ(device.opened, 0);
  EXPECT_EQ(device.pinned, 1);  // the system region stays
  ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "s", "").ok());
  EXPECT_EQ(device.pinned, 0);
}

// A device whose first PinHost waits until the test lets it go: a registration caught mid-way.
class BlockingDevice : public FakeDevice {
 public:
  bool PinHost(void* data, size_t bytes) override {
    std::unique_lock<std::mutex> lock(mu);
    ++pin_calls;
    changed.notify_all();
    changed.wait(lock, [this] { return go || pin_calls > 1; });
    return FakeDevice::PinHost(data, bytes);
  }
  void WaitForPins(int n) {
    std::unique_lock<std::mutex> lock(mu);
    changed.wait(lock, [&] { return pin_calls >= n; });
  }
  void Go() {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
    changed.notify_all();
  }
  std::mutex mu;
  std::condition_variable changed;
  int pin_calls = 0;
  bool go = false;
};

// Registrations that all passed the checks, then each mapped and page-locked up to --shm_max_bytes
// before one of them won, could pin many times the limit at once (a sparse object's pages are
// allocated as they are locked). A registration now holds its name, slot and bytes while it maps.
TEST(ShmRegistry, ARegistrationHoldsItsNameAndBytesWhileItMaps) {
  ShmObject object(8192);
  BlockingDevice device;
  ShmLimits limits = Allowed();
  limits.max_bytes = 8192;
  limits.max_regions = 2;
  ShmRegistry registry(limits, &device);
  absl::Status first;
  std::thread mapping([&] { first = registry.RegisterSystem("a", object.key(), 0, 8192, "x"); });
  device.WaitForPins(1);
  EXPECT_EQ(registry.RegisterSystem("a", object.key(), 0, 1, "x").code(),
            absl::StatusCode::kAlreadyExists);
  const absl::Status over = registry.RegisterSystem("b", object.key(), 0, 4096, "x");
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_EQ(registry.region_bytes(), 8192);
  EXPECT_EQ(registry.region_count(), 0);  // not registered yet: not leasable, not listed
  EXPECT_EQ(registry.Lease("a", 0, 1, "x").status().code(), absl::StatusCode::kNotFound);
  {
    std::lock_guard<std::mutex> lock(device.mu);
    EXPECT_EQ(device.pin_calls, 1);  // the refused ones mapped and pinned nothing
  }
  device.Go();
  mapping.join();
  ASSERT_TRUE(first.ok()) << first;
  EXPECT_EQ(registry.region_count(), 1);
  // A registration that fails gives its name and bytes back.
  ASSERT_TRUE(registry.Unregister(ShmType::kSystem, "a", "x").ok());
  EXPECT_FALSE(registry.RegisterSystem("b", "/fs_shm_test_missing_object", 0, 8192, "x").ok());
  EXPECT_EQ(registry.region_bytes(), 0);
  EXPECT_TRUE(registry.RegisterSystem("b", object.key(), 0, 8192, "x").ok());
}

// cudaIpcOpenMemHandle opens a handle twice to one pointer (as the fake does): two names for one
// allocation are the same memory.
TEST(ShmOverlaps, TwoNamesForOneCudaAllocationAreTheSameMemory) {
  FakeDevice device;
  ShmRegistry registry(Allowed(), &device);
  ASSERT_TRUE(registry.RegisterCuda("c", std::string(64, 'h'), 0, 256, "").ok());
  ASSERT_TRUE(registry.RegisterCuda("c2", std::string(64, 'h'), 0, 128, "").ok());
  absl::StatusOr<ShmSpan> in = registry.Lease("c", 64, 32, "");
  absl::StatusOr<ShmSpan> out = registry.Lease("c2", 80, 16, "");
  absl::StatusOr<ShmSpan> next = registry.Lease("c2", 96, 16, "");
  ASSERT_TRUE(in.ok() && out.ok() && next.ok());
  EXPECT_TRUE(in->memory == out->memory);
  EXPECT_EQ(out->position, reinterpret_cast<uintptr_t>(device.memory) + 80);
  const absl::Status s =
      CheckShmOverlaps({UseOf(*in, "Q", "c", 64, false), UseOf(*out, "O", "c2", 80, true)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("O (region \"c2\", offset 80, 16 bytes) overlaps Q"),
            std::string::npos)
      << s;
  EXPECT_TRUE(
      CheckShmOverlaps({UseOf(*in, "Q", "c", 64, false), UseOf(*next, "O", "c2", 96, true)}).ok());
}

TEST(ShmRegistry, CudaRegionsNeedADevice) {
  ShmRegistry registry(Allowed(), nullptr);
  absl::Status s = registry.RegisterCuda("c", std::string(64, 'h'), 0, 256, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("CUDA backend"), std::string::npos) << s;
}

}  // namespace
}  // namespace flashserve
