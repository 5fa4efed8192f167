#include "loadgen_targets.h"

#include "loadgen_format.h"

namespace flashserve::loadgen {
namespace {

struct Target {
  const char* name;
  const char* shape;
  const char* path;
  double (*bound)(const C1Row&);
};

const Target kTargets[] = {
    {"medium via CUDA shm <= kernel + 100 us", "medium", "cuda",
     [](const C1Row& r) { return r.kernel + 100; }},
    {"small via CUDA shm <= 60 us end to end", "small", "cuda", [](const C1Row&) { return 60.0; }},
    {"medium via system shm <= h2d + kernel + d2h + 150 us", "medium", "system",
     [](const C1Row& r) { return r.h2d + r.kernel + r.d2h + 150; }},
};

}  // namespace

C1Row C1Of(const CellResult& r) {
  return {Percentile(r.latency_us, 0.5), Percentile(Column(r, 4), 0.5), Percentile(Column(r, 1), 0.5),
          Percentile(Column(r, 2), 0.5), Percentile(Column(r, 3), 0.5)};
}

std::string TargetsTable(const std::string& title, const C1Rows& c1, const std::string& floor_path) {
  const bool with_floor = !floor_path.empty();
  std::string md = "\n#### " + title + "\n\n| target | measured p50 us | bound us | met? | server total us | " +
                   (with_floor ? "floor: " + floor_path + " us | rest us |\n|---|---|---|---|---|---|---|\n"
                               : "client + transport us |\n|---|---|---|---|---|---|\n");
  for (const Target& t : kTargets) {
    auto it = c1.find(std::string(t.shape) + "/" + t.path);
    if (it == c1.end()) {
      md += std::string("| ") + t.name + " | not measured |  |  |  |  |" + (with_floor ? "  |\n" : "\n");
      continue;
    }
    const C1Row& r = it->second;
    const double bound = t.bound(r);
    md += Fmt("| %s | %.0f | %.0f | %s | %.0f |", t.name, r.p50, bound, r.p50 <= bound ? "yes" : "no",
              r.total);
    if (!with_floor) {
      md += Fmt(" %.0f |\n", r.p50 - r.total);
      continue;
    }
    auto floor = c1.find(std::string(t.shape) + "/" + floor_path);
    md += floor == c1.end() ? " not measured |  |\n"
                            : Fmt(" %.0f | %.0f |\n", floor->second.p50, r.p50 - r.total - floor->second.p50);
  }
  return md;
}

}  // namespace flashserve::loadgen
