// The benchmark tools' command line: `--name=value` arguments, each name one the tool declares.
// An unknown name, an argument not of that form or a value that is not the number asked for is
// an error: the tool's usage on stderr and exit status 2 (a typo must not quietly run a different
// benchmark). `--help` prints the usage on stdout and exits 0. An empty value (`--stripes=`) is a
// value like any other. Main thread only.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace flashserve::bench {

class Flags {
 public:
  /// Parses argv; exits as the header says on a bad argument or --help.
  Flags(int argc, char** argv, const char* usage, const std::set<std::string>& known)
      : usage_(usage) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        std::printf("%s", usage_);
        std::exit(0);
      }
      const size_t eq = arg.find('=');
      if (arg.rfind("--", 0) != 0 || eq == std::string::npos)
        Fail("expected --name=value, got '" + arg + "'");
      const std::string name = arg.substr(2, eq - 2);
      if (known.count(name) == 0) Fail("unknown flag --" + name);
      values_[name] = arg.substr(eq + 1);  // the last of repeated flags wins
    }
  }

  bool Has(const std::string& name) const { return values_.count(name) != 0; }

  std::string Str(const std::string& name, const std::string& def) const {
    auto it = values_.find(name);
    return it == values_.end() ? def : it->second;
  }

  double Double(const std::string& name, double def) const {
    auto it = values_.find(name);
    return it == values_.end() ? def : ParseDouble(name, it->second);
  }

  int64_t Int(const std::string& name, int64_t def) const {
    auto it = values_.find(name);
    return it == values_.end() ? def : ParseInt(name, it->second);
  }

  /// A comma-separated list; empty items are skipped ("1,,4" is {1, 4}; "" is {}).
  std::vector<std::string> List(const std::string& name, const std::string& def) const {
    std::vector<std::string> out;
    const std::string text = Str(name, def);
    for (size_t start = 0; start <= text.size();) {
      const size_t comma = text.find(',', start);
      const size_t end = comma == std::string::npos ? text.size() : comma;
      if (end > start) out.push_back(text.substr(start, end - start));
      start = end + 1;
    }
    return out;
  }

  std::vector<int> IntList(const std::string& name, const std::string& def) const {
    std::vector<int> out;
    for (const std::string& item : List(name, def)) {
      const int64_t v = ParseInt(name, item);
      if (v < INT32_MIN || v > INT32_MAX) Fail("--" + name + ": out of range: '" + item + "'");
      out.push_back(int(v));
    }
    return out;
  }

  /// Prints `message` and the usage to stderr and exits 2 (also for checks the tool makes itself).
  [[noreturn]] void Fail(const std::string& message) const {
    std::fprintf(stderr, "error: %s\n\n%s", message.c_str(), usage_);
    std::exit(2);
  }

 private:
  double ParseDouble(const std::string& name, const std::string& text) const {
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno != 0)
      Fail("--" + name + ": not a number: '" + text + "'");
    return v;
  }

  int64_t ParseInt(const std::string& name, const std::string& text) const {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0)
      Fail("--" + name + ": not an integer: '" + text + "'");
    return int64_t(v);
  }

  const char* usage_;
  std::map<std::string, std::string> values_;
};

}  // namespace flashserve::bench
