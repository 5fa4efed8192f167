#include "autotune/tune_grid.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace flashserve {
namespace {

absl::StatusOr<kernels::DType> ParseDType(absl::string_view text) {
  if (text == "fp16" || text == "float16") return kernels::DType::kFloat16;
  if (text == "bf16" || text == "bfloat16") return kernels::DType::kBFloat16;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", text, "\" (fp16, bf16)"));
}

absl::StatusOr<int> ParsePositive(absl::string_view text, absl::string_view what) {
  int value = 0;
  if (!absl::SimpleAtoi(text, &value) || value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", text, "\" is not a positive integer"));
  }
  return value;
}

absl::StatusOr<std::vector<bool>> ParseCausal(absl::string_view text) {
  std::vector<bool> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    if (part == "both") {
      out.push_back(false);
      out.push_back(true);
    } else if (part == "yes" || part == "causal" || part == "true" || part == "1") {
      out.push_back(true);
    } else if (part == "no" || part == "full" || part == "false" || part == "0") {
      out.push_back(false);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("causal: \"", part, "\" (yes, no, both)"));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<TuneGrid> ParseTuneGrid(const std::string& dtypes, const std::string& head_dims,
                                       const std::string& causal, const std::string& seqlens,
                                       const std::string& gqa) {
  std::vector<kernels::DType> dtype_list;
  for (absl::string_view part : absl::StrSplit(dtypes, ',', absl::SkipWhitespace())) {
    absl::StatusOr<kernels::DType> d = ParseDType(part);
    if (!d.ok()) return d.status();
    dtype_list.push_back(*d);
  }
  std::vector<int> head_dim_list;
  for (absl::string_view part : absl::StrSplit(head_dims, ',', absl::SkipWhitespace())) {
    absl::StatusOr<int> v = ParsePositive(part, "head_dim");
    if (!v.ok()) return v.status();
    head_dim_list.push_back(*v);
  }
  absl::StatusOr<std::vector<bool>> causal_list = ParseCausal(causal);
  if (!causal_list.ok()) return causal_list.status();
  std::vector<std::pair<int, int>> seqlen_list;
  for (absl::string_view part : absl::StrSplit(seqlens, ',', absl::SkipWhitespace())) {
    std::vector<absl::string_view> qk = absl::StrSplit(part, ':');
    if (qk.size() > 2) return absl::InvalidArgumentError(absl::StrCat("seqlens: \"", part, "\""));
    absl::StatusOr<int> q = ParsePositive(qk[0], "seqlen_q");
    if (!q.ok()) return q.status();
    absl::StatusOr<int> k = qk.size() == 2 ? ParsePositive(qk[1], "seqlen_k") : q;
    if (!k.ok()) return k.status();
    seqlen_list.emplace_back(*q, *k);
  }
  std::vector<int> gqa_list;
  for (absl::string_view part : absl::StrSplit(gqa, ',', absl::SkipWhitespace())) {
    absl::StatusOr<int> v = ParsePositive(part, "gqa");
    if (!v.ok()) return v.status();
    gqa_list.push_back(*v);
  }
  if (dtype_list.empty() || head_dim_list.empty() || causal_list->empty() || seqlen_list.empty() ||
      gqa_list.empty()) {
    return absl::InvalidArgumentError(
        "tuning grid: every list (dtypes, head_dims, causal, seqlens, gqa) needs a value");
  }
  TuneGrid grid;
  for (kernels::DType dtype : dtype_list)
    for (int head_dim : head_dim_list)
      for (bool c : *causal_list)
        for (const auto& [q, k] : seqlen_list)
          for (int ratio : gqa_list) grid.points.push_back({dtype, head_dim, c, q, k, ratio});
  return grid;
}

absl::StatusOr<TuneGrid> ReadShapesFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  TuneGrid grid;
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    absl::string_view text = line;
    if (size_t hash = text.find('#'); hash != absl::string_view::npos) text = text.substr(0, hash);
    std::vector<absl::string_view> fields = absl::StrSplit(text, ' ', absl::SkipWhitespace());
    if (fields.empty()) continue;
    if (fields.size() != 5 && fields.size() != 6) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", line_number, ": expected \"dtype head_dim causal seqlen_q seqlen_k [gqa]\""));
    }
    absl::StatusOr<TuneGrid> point = ParseTuneGrid(
        std::string(fields[0]), std::string(fields[1]), std::string(fields[2]),
        absl::StrCat(fields[3], ":", fields[4]), fields.size() == 6 ? std::string(fields[5]) : "1");
    if (!point.ok() || point->points.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": ",
                       point.ok() ? "one value per field" : std::string(point.status().message())));
    }
    grid.points.push_back(point->points[0]);
  }
  if (grid.points.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no shapes"));
  return grid;
}

std::vector<ProblemClass> GridClasses(const TuneGrid& grid, const DeviceIdentity& device) {
  std::vector<ProblemClass> classes;
  std::set<std::string> seen;
  for (const TunePoint& point : grid.points) {
    const int heads_kv = 8;
    auto p = kernels::make_contiguous_params(point.dtype, 1, point.seqlen_q, point.seqlen_k,
                                             heads_kv * point.gqa_ratio, heads_kv, point.head_dim,
                                             point.causal, 1.f);
    ProblemClass c = ClassOf(p, device);
    if (seen.insert(c.key()).second) classes.push_back(c);
  }
  return classes;
}

}  // namespace flashserve
