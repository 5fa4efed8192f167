// Bearer-token checks: exact match only, scheme case-insensitive, short tokens refused.
#include "common/auth.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

TEST(ConstantTimeEquals, ExactBytesOnly) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", ""));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0c", 3), "a"));
}

TEST(BearerAuth, AllowsOnlyTheToken) {
  auto auth = BearerAuth::FromToken("  0123456789abcdefXYZ\n");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->Allows("Bearer 0123456789abcdefXYZ"));
  EXPECT_TRUE((*auth)->Allows("bearer 0123456789abcdefXYZ"));  // scheme is case-insensitive
  EXPECT_FALSE((*auth)->Allows("Bearer 0123456789abcdefXY"));
  EXPECT_FALSE((*auth)->Allows("Bearer 0123456789abcdefXYZZ"));
  EXPECT_FALSE((*auth)->Allows("Bearer 0123456789abcdefxyz"));  // the token is case-sensitive
  EXPECT_FALSE((*auth)->Allows("Basic 0123456789abcdefXYZ"));
  EXPECT_FALSE((*auth)->Allows("0123456789abcdefXYZ"));
  EXPECT_FALSE((*auth)->Allows(""));
  EXPECT_FALSE((*auth)->Allows("Bearer "));
}

TEST(BearerAuth, RefusesWeakTokens) {
  EXPECT_FALSE(BearerAuth::FromToken("").ok());
  EXPECT_FALSE(BearerAuth::FromToken("short").ok());
  EXPECT_FALSE(BearerAuth::FromToken("has a space in the middle!").ok());
  EXPECT_FALSE(BearerAuth::FromFile("/nonexistent/token").ok());
}

TEST(BearerAuth, ReadsFile) {
  // This process's own name: another test run on the machine (or a stale file of another user's)
  // must not race it.
  const std::string path = ::testing::TempDir() + "/flashserve-token-" + std::to_string(getpid()) +
                           "-" + std::to_string(std::random_device{}());
  std::ofstream(path) << "file-token-0123456789\n";
  auto auth = BearerAuth::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->Allows("Bearer file-token-0123456789"));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace flashserve
