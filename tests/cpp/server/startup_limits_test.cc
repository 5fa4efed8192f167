// Startup checks of values the host or the URL space must hold: --model_name (a REST path
// segment, a metric label, a log field) and the host-memory bound that --kv_cache_bytes is held
// to on the CPU backend (memory/host_memory_bound.h), read from files a test lays out.
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/http_listener.h"
#include "config/server_config.h"
#include "gtest/gtest.h"
#include "memory/host_memory_bound.h"

namespace flashserve {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A directory standing in for /sys/fs/cgroup and /proc/self/cgroup.
class HostMemoryBoundTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/flashserve-host-memory-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    sources_.physical_bytes = 64 * kGiB;
    sources_.cgroup_root = dir_ + "/cgroup";
    sources_.proc_self_cgroup = dir_ + "/self_cgroup";
    std::filesystem::create_directories(sources_.cgroup_root);
    Write(sources_.proc_self_cgroup, "0::/\n");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes `text` to `path`, making its directories.
  static void Write(const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << text;
  }
  void Limit(const std::string& cgroup, const std::string& value) {
    Write(absl::StrCat(sources_.cgroup_root, cgroup, "/memory.max"), value + "\n");
  }

  std::string dir_;
  HostMemorySources sources_;
};

TEST_F(HostMemoryBoundTest, PhysicalMemoryWithoutACgroupLimit) {
  Limit("", "max");  // cgroup v2's "no limit"
  const HostMemoryBound bound = ReadHostMemoryBound(sources_);
  EXPECT_EQ(bound.bytes, 64 * kGiB);
  EXPECT_EQ(bound.source, "physical memory");
}

TEST_F(HostMemoryBoundTest, AContainersLimitIsTheRootsMemoryMax) {
  Limit("", std::to_string(8 * kGiB));
  const HostMemoryBound bound = ReadHostMemoryBound(sources_);
  EXPECT_EQ(bound.bytes, 8 * kGiB);
  EXPECT_EQ(bound.source,
            absl::StrCat("the cgroup memory limit in ", sources_.cgroup_root, "/memory.max"));
}

TEST_F(HostMemoryBoundTest, ALimitLargerThanPhysicalMemoryIsNoBound) {
  Limit("", std::to_string(128 * kGiB));
  EXPECT_EQ(ReadHostMemoryBound(sources_).bytes, 64 * kGiB);
}

// A systemd service or a nested cgroup: every ancestor's memory.max holds; the smallest wins.
TEST_F(HostMemoryBoundTest, TheSmallestLimitOfTheCgroupAndItsAncestorsHolds) {
  Write(sources_.proc_self_cgroup, "0::/system.slice/flashserve.service\n");
  Limit("/system.slice", std::to_string(4 * kGiB));
  Limit("/system.slice/flashserve.service", std::to_string(6 * kGiB));
  HostMemoryBound bound = ReadHostMemoryBound(sources_);
  EXPECT_EQ(bound.bytes, 4 * kGiB);
  EXPECT_NE(bound.source.find("/system.slice/memory.max"), std::string::npos) << bound.source;

  Limit("/system.slice/flashserve.service", std::to_string(2 * kGiB));
  bound = ReadHostMemoryBound(sources_);
  EXPECT_EQ(bound.bytes, 2 * kGiB);
  EXPECT_NE(bound.source.find("/flashserve.service/memory.max"), std::string::npos) << bound.source;
}

// Without a cgroup namespace a container sees the host's path of its cgroup, not the directories:
// the walk still reaches the root's file. A cgroup outside the namespace ("/../x") reads only it.
TEST_F(HostMemoryBoundTest, ACgroupPathThatIsNotThereEndsAtTheRoot) {
  Limit("", std::to_string(3 * kGiB));
  for (const char* line : {"0::/docker/0123abcd\n", "0::/../../elsewhere\n", "", "1:cpu:/x\n"}) {
    Write(sources_.proc_self_cgroup, line);
    EXPECT_EQ(ReadHostMemoryBound(sources_).bytes, 3 * kGiB) << line;
  }
  std::filesystem::remove(sources_.proc_self_cgroup);
  EXPECT_EQ(ReadHostMemoryBound(sources_).bytes, 3 * kGiB);
}

TEST_F(HostMemoryBoundTest, CgroupV1LimitCountsWhenSmaller) {
  const std::string v1 = sources_.cgroup_root + "/memory/memory.limit_in_bytes";
  Write(v1, "9223372036854771712\n");  // v1's "no limit"
  EXPECT_EQ(ReadHostMemoryBound(sources_).bytes, 64 * kGiB);
  Write(v1, std::to_string(5 * kGiB) + "\n");
  EXPECT_EQ(ReadHostMemoryBound(sources_).bytes, 5 * kGiB);
}

TEST_F(HostMemoryBoundTest, UnparsableLimitsAreIgnoredAndNothingKnownRefusesNothing) {
  Limit("", "lots\n");
  sources_.physical_bytes = 0;  // sysconf could not tell
  const HostMemoryBound bound = ReadHostMemoryBound(sources_);
  EXPECT_EQ(bound.bytes, 0);
  EXPECT_TRUE(CheckFitsHostMemory("kv_cache_bytes", int64_t{1} << 60, bound).ok());
}

TEST(CheckFitsHostMemoryTest, UpToTheBoundFitsOneByteMoreIsRefusedNamingFlagClaimAndBound) {
  const HostMemoryBound bound{8 * kGiB, "the cgroup memory limit in /sys/fs/cgroup/memory.max"};
  EXPECT_TRUE(CheckFitsHostMemory("kv_cache_bytes", 8 * kGiB, bound).ok());
  const absl::Status refused = CheckFitsHostMemory("kv_cache_bytes", 8 * kGiB + 1, bound);
  ASSERT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : {std::string("--kv_cache_bytes=8589934593 (8.0 GiB)"),
                                  bound.source, std::string("8589934592 bytes (8.0 GiB)")}) {
    EXPECT_NE(refused.message().find(part), std::string::npos) << refused.message();
  }
}

// This machine: it has some memory, and not 2^60 bytes of it.
TEST(CheckFitsHostMemoryTest, ThisHostsBoundIsKnownAndRefusesAnExabyte) {
  const HostMemoryBound bound = ReadHostMemoryBound();
  EXPECT_GT(bound.bytes, 0) << "neither sysconf nor a cgroup told this host's memory";
  EXPECT_FALSE(CheckFitsHostMemory("kv_cache_bytes", int64_t{1} << 60, bound).ok());
}

absl::Status CheckName(const std::string& name) {
  ModelOptions model;
  model.model_name = name;
  return model.Check();
}

TEST(ModelNameTest, UrlSafeNamesUpToTheLimitAreAccepted) {
  for (const std::string& name :
       {std::string("attention"), std::string("llama-3.1_8B"), std::string("a"), std::string("..."),
        std::string(ModelOptions::kMaxNameBytes, 'm')}) {
    EXPECT_TRUE(CheckName(name).ok()) << name << ": " << CheckName(name);
  }
}

// The longest KServe route with the longest name stays inside the HTTP listener's 414 limit.
TEST(ModelNameTest, TheLongestNameLeavesItsRoutesReachable) {
  const std::string longest = absl::StrCat(
      "/v2/models/", std::string(ModelOptions::kMaxNameBytes, 'm'), "/versions/1/infer");
  EXPECT_LT(longest.size(), kMaxPathBytes);
}

TEST(ModelNameTest, NamesAClientCannotUseInAUrlAreRefusedWithoutEchoingTheByte) {
  const std::string too_long(ModelOptions::kMaxNameBytes + 1, 'm');
  for (const std::string& name :
       {std::string(), too_long, std::string(4000, 'm'), std::string("a/b"), std::string("a b"),
        std::string("a\nb"), std::string("a\rb"), std::string("a\x1b[31m"), std::string("a\x7f"),
        std::string("a%2Fb"), std::string("a?b"), std::string("a#b"), std::string("a~b"),
        std::string("a:b"), std::string("\xc3\xa9t\xc3\xa9"), std::string("a\0b", 3),
        std::string("."), std::string("..")}) {
    const absl::Status status = CheckName(name);
    ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << "accepted: " << name;
    const std::string message(status.message());
    EXPECT_EQ(message.rfind("--model_name ", 0), 0u) << message;
    EXPECT_NE(message.find("letters, digits, '_', '-' and '.'"), std::string::npos) << message;
    for (char c : message) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "message carries byte " << int(uint8_t(c));
    }
  }
  EXPECT_NE(std::string(CheckName("a\nb").message()).find("byte 0x0a at offset 1"),
            std::string::npos);
  EXPECT_NE(std::string(CheckName(too_long).message()).find("is 257 bytes"), std::string::npos);
}

}  // namespace
}  // namespace flashserve
