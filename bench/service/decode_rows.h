// flashserve-decode-loadgen's closed loop and its output: clients stepping on threads of their own,
// the samples they measure, and one JSON line per row (decode_bench.py --cpp_loadgen reads them).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flashserve::loadgen {

// Per measured step of one client: wall latency and the server's timing of that call.
struct Sample {
  double latency_us = 0;
  int64_t total_us = 0, compute_us = 0, merged = 0;
  // Where the server's time went (Timing: parse and build, queue, row staging, and the device
  // times of the input copy + row scatter, the decode kernel and the output copy).
  int64_t prepare_us = 0, queue_us = 0, stage_us = 0, h2d_us = 0, kernel_us = 0, d2h_us = 0;
  double client_wall_s = 0;  // how long this sample's client took for all its steps
  int64_t length = 0;  // keys its first item attended (the prefix plus every token appended so far)
};

/// Runs call(client, &sample, &error) warmup + steps times on each of `clients` threads; returns
/// the measured samples and the wall seconds from the first measured step to the last. A failed
/// call stops its client; *error then holds the first failure.
using StepCall = std::function<bool(int, Sample*, std::string*)>;
std::vector<Sample> RunClients(int clients, int steps, int warmup, const StepCall& call,
                               double* wall_s, std::string* error);

/// The p-th percentile (0..100) of v, interpolated; 0 for none.
double Percentile(std::vector<double> v, double p);

/// What every row says of its run besides its samples.
struct RowShape {
  int64_t context = 0, sequences = 0;
  int steps = 0;
};

/// One measured row: latency percentiles, throughput, the server's timings (medians, and those of
/// the calls at or above the p99), then `extra` (JSON fields, each starting ", ").
void PrintRow(const std::string& path, const RowShape& shape, int clients,
              const std::vector<Sample>& samples, double wall_s, const std::string& extra);
/// A row that could not be measured: what failed, in the row's place (decode_bench.py shows it).
void PrintError(const std::string& path, const RowShape& shape, int clients,
                const std::string& error);
/// text with quotes and backslashes escaped and control characters as spaces.
std::string JsonEscape(const std::string& text);

}  // namespace flashserve::loadgen
