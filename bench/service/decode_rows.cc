#include "decode_rows.h"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <thread>
#include <utility>

#include "loadgen_workload.h"

namespace flashserve::loadgen {

std::vector<Sample> RunClients(int clients, int steps, int warmup, const StepCall& call,
                               double* wall_s, std::string* error) {
  std::vector<std::vector<Sample>> per(static_cast<size_t>(clients));
  std::vector<Clock::time_point> starts(static_cast<size_t>(clients)),
      ends(static_cast<size_t>(clients));
  std::vector<std::string> errors(static_cast<size_t>(clients));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      std::string& failed = errors[size_t(c)];
      Sample ignored;
      for (int i = 0; i < warmup && failed.empty(); ++i) call(c, &ignored, &failed);
      starts[size_t(c)] = ends[size_t(c)] = Clock::now();
      for (int i = 0; i < steps && failed.empty(); ++i) {
        Sample s;
        const Clock::time_point t0 = Clock::now();
        if (!call(c, &s, &failed)) break;
        s.latency_us = Micros(Clock::now() - t0);
        per[size_t(c)].push_back(s);
      }
      ends[size_t(c)] = Clock::now();
      const double wall = Micros(ends[size_t(c)] - starts[size_t(c)]) / 1e6;
      for (Sample& s : per[size_t(c)]) s.client_wall_s = wall;
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) {
    if (error->empty() && !e.empty()) *error = e;
  }
  *wall_s = Micros(*std::max_element(ends.begin(), ends.end()) -
                   *std::min_element(starts.begin(), starts.end())) /
            1e6;
  std::vector<Sample> all;
  for (auto& v : per) all.insert(all.end(), v.begin(), v.end());
  return all;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

namespace {

// The server's timings of a sample, by the names the JSON rows give them.
using SampleTiming = std::pair<const char*, int64_t Sample::*>;
constexpr SampleTiming kTimings[] = {
    {"total", &Sample::total_us},     {"compute", &Sample::compute_us},
    {"prepare", &Sample::prepare_us}, {"queue", &Sample::queue_us},
    {"stage", &Sample::stage_us},     {"h2d", &Sample::h2d_us},
    {"kernel", &Sample::kernel_us},   {"d2h", &Sample::d2h_us}};

// `, "<prefix><name>_us": <median over samples>` for each timing in [first, last).
std::string MediansJson(const std::vector<const Sample*>& samples, const char* prefix,
                        const SampleTiming* first, const SampleTiming* last) {
  std::string out;
  for (const SampleTiming* t = first; t != last; ++t) {
    std::vector<double> values;
    for (const Sample* s : samples) values.push_back(double(s->*(t->second)));
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), ", \"%s%s_us\": %.1f", prefix, t->first,
                  Percentile(values, 50));
    out += buffer;
  }
  return out;
}

// Where the slowest calls' time went: the median of each server time over the calls at or
// above the p99 latency (inside the server, or outside it), and the slowest and fastest
// client's wall time for its steps (how unevenly the server served the clients).
std::string SlowCallsJson(const std::vector<Sample>& samples, double p99_us) {
  if (samples.empty()) return "";
  std::vector<const Sample*> slow;
  for (const Sample& s : samples) {
    if (s.latency_us >= p99_us) slow.push_back(&s);
  }
  std::vector<double> walls;
  for (const Sample& s : samples) walls.push_back(s.client_wall_s);
  char buffer[96];
  std::snprintf(
      buffer, sizeof(buffer), ", \"client_wall_s_min\": %.3f, \"client_wall_s_max\": %.3f",
      *std::min_element(walls.begin(), walls.end()), *std::max_element(walls.begin(), walls.end()));
  return MediansJson(slow, "slow_", std::begin(kTimings), std::end(kTimings)) + buffer;
}

}  // namespace

void PrintRow(const std::string& path, const RowShape& shape, int clients,
              const std::vector<Sample>& samples, double wall_s, const std::string& extra) {
  std::vector<double> latency, total, compute, merged, length;
  for (const Sample& s : samples) {
    latency.push_back(s.latency_us / 1e3);
    length.push_back(double(s.length));
    total.push_back(double(s.total_us));
    compute.push_back(double(s.compute_us));
    merged.push_back(double(s.merged));
  }
  double merged_mean = 0;
  for (double m : merged) merged_mean += m / double(merged.size());
  std::vector<const Sample*> all;
  for (const Sample& s : samples) all.push_back(&s);
  // server_total_us and server_compute_us are in the row's fixed part.
  const std::string stages = SlowCallsJson(samples, Percentile(latency, 99) * 1e3) +
                             MediansJson(all, "server_", kTimings + 2, std::end(kTimings));
  std::printf(
      "{\"path\": \"%s\", \"client\": \"C++\", \"context\": %lld, \"concurrency\": %d, \"n\": %zu, "
      "\"p50_ms\": %.4f, \"p99_ms\": %.4f, \"seq_steps_per_s\": %.1f, \"server_total_us\": %.1f, "
      "\"server_compute_us\": %.1f, \"batched_calls_mean\": %.3f, \"attended_p50\": %.0f%s%s}\n",
      path.c_str(), (long long)shape.context, clients, samples.size(), Percentile(latency, 50),
      Percentile(latency, 99), double(shape.sequences) * double(shape.steps) / wall_s,
      Percentile(total, 50), Percentile(compute, 50), merged_mean, Percentile(length, 50),
      stages.c_str(), extra.c_str());
  std::fflush(stdout);
}

std::string JsonEscape(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) {
      out += ' ';
      continue;
    }
    out += ch;
  }
  return out;
}

void PrintError(const std::string& path, const RowShape& shape, int clients,
                const std::string& error) {
  std::fprintf(stderr, "decode-loadgen: %s, %d clients: %s\n", path.c_str(), clients,
               error.c_str());
  std::printf(
      "{\"path\": \"%s\", \"client\": \"C++\", \"context\": %lld, \"concurrency\": %d, "
      "\"error\": \"%s\"}\n",
      path.c_str(), (long long)shape.context, clients, JsonEscape(error).c_str());
  std::fflush(stdout);
}

}  // namespace flashserve::loadgen
