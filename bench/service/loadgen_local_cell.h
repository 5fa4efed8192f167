// The closed-loop cell over the local transport (local_client.h): `concurrency` threads, each on
// its own connection with one call in flight, the same payload re-sent as the last reply arrives,
// for a duration (at least min_requests calls). Results in loadgen_cell.h's CellResult, so the
// tables and statistics are the gRPC cells'.
#pragma once

#include <string>

#include "local_client.h"
#include "loadgen_cell.h"

namespace flashserve::loadgen {

struct LocalCellSpec {
  std::string target_name;
  local::LocalClientOptions client;
  local::Method method = local::Method::kEcho;
  const std::string* payload = nullptr;
  int concurrency = 1;
  double duration_s = 2;
  int min_requests = 3;
  bool read_timing = false;        // the reply is an AttentionResponse: read its timing
  int64_t expect_reply_bytes = -1;  // >= 0: a reply of another size counts as an error (echo)
};

CellResult RunLocalCell(const LocalCellSpec& spec);

}  // namespace flashserve::loadgen
