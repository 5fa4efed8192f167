// Issue 18's latency targets, computed from the c=1 rows of a shared-memory table: medium via CUDA
// shm <= kernel + 100 us, small via CUDA shm <= 60 us end to end, medium via system shm <=
// h2d + kernel + d2h + 150 us (each bound from the same row's server timing).
#pragma once

#include <map>
#include <string>

#include "loadgen_cell.h"

namespace flashserve::loadgen {

/// The c=1 medians of one (shape, path) row.
struct C1Row {
  double p50 = 0, total = 0, h2d = 0, kernel = 0, d2h = 0;
};
using C1Rows = std::map<std::string, C1Row>;  // key "shape/path", e.g. "medium/cuda"

C1Row C1Of(const CellResult& r);

/// The markdown table of the three targets; `floor_path` names the rows (same shape) whose p50 is
/// the transport's floor for them (e.g. "echo (shm request bytes)"; empty: no such column).
std::string TargetsTable(const std::string& title, const C1Rows& c1, const std::string& floor_path);

}  // namespace flashserve::loadgen
