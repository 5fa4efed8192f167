// The benchmark tools' flag parser (bench/service/bench_flags.h): known flags are read and typed,
// anything else ends the tool with its usage and exit status 2.
#include "bench_flags.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve::bench {
namespace {

constexpr char kUsage[] = "usage: tool [--n=1] [--x=0.5] [--list=1,2] [--name=S]\n";

// Parses `args` (the program name is added) with the flags n, x, list and name.
Flags Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "tool");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return Flags(int(argv.size()), argv.data(), kUsage, {"n", "x", "list", "name"});
}

TEST(BenchFlags, ReadsKnownFlagsAndDefaults) {
  const Flags flags = Parse({"--n=-7", "--x=0.25", "--list=1,,16", "--name=a=b", "--n=12"});
  EXPECT_EQ(flags.Int("n", 0), 12);  // the last of repeated flags
  EXPECT_DOUBLE_EQ(flags.Double("x", 0), 0.25);
  EXPECT_EQ(flags.IntList("list", ""), (std::vector<int>{1, 16}));
  EXPECT_EQ(flags.Str("name", ""), "a=b");  // only the first '=' separates
  EXPECT_FALSE(flags.Has("missing"));
  EXPECT_EQ(flags.Str("missing", "dflt"), "dflt");
  EXPECT_EQ(flags.List("missing", "a,b"), (std::vector<std::string>{"a", "b"}));
}

TEST(BenchFlags, EmptyValueIsAValue) {
  const Flags flags = Parse({"--list="});
  EXPECT_TRUE(flags.Has("list"));
  EXPECT_TRUE(flags.IntList("list", "1,2").empty());
}

TEST(BenchFlags, UnknownFlagExitsWithUsage) {
  EXPECT_EXIT(Parse({"--n=1", "--durration_s=2"}), testing::ExitedWithCode(2),
              "unknown flag --durration_s.*usage: tool");
}

TEST(BenchFlags, ArgumentWithoutValueOrDashesExits) {
  EXPECT_EXIT(Parse({"--n"}), testing::ExitedWithCode(2), "expected --name=value, got '--n'");
  EXPECT_EXIT(Parse({"n=1"}), testing::ExitedWithCode(2), "expected --name=value");
}

TEST(BenchFlags, MalformedNumbersExit) {
  EXPECT_EXIT(Parse({"--n=12x"}).Int("n", 0), testing::ExitedWithCode(2),
              "--n: not an integer: '12x'");
  EXPECT_EXIT(Parse({"--n="}).Int("n", 0), testing::ExitedWithCode(2), "--n: not an integer: ''");
  EXPECT_EXIT(Parse({"--n=1.5"}).Int("n", 0), testing::ExitedWithCode(2), "not an integer");
  EXPECT_EXIT(Parse({"--n=99999999999999999999"}).Int("n", 0), testing::ExitedWithCode(2),
              "not an integer");
  EXPECT_EXIT(Parse({"--x=fast"}).Double("x", 0), testing::ExitedWithCode(2),
              "--x: not a number: 'fast'");
  EXPECT_EXIT(Parse({"--list=1,two"}).IntList("list", ""), testing::ExitedWithCode(2),
              "not an integer: 'two'");
  EXPECT_EXIT(Parse({"--list=1,4294967296"}).IntList("list", ""), testing::ExitedWithCode(2),
              "out of range");
}

TEST(BenchFlags, HelpPrintsUsageAndExitsZero) {
  EXPECT_EXIT(Parse({"--n=1", "--help"}), testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve::bench
