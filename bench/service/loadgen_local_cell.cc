#include "loadgen_local_cell.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace flashserve::loadgen {
namespace {

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct LocalWorker {
  std::unique_ptr<local::LocalClient> client;
  int64_t ok = 0, errors = 0, response_bytes = 0;
  std::string first_error;
  std::vector<double> latency_us;
  std::vector<std::array<int64_t, 6>> timings;

  void Error(const std::string& what) {
    ++errors;
    if (first_error.empty()) first_error = what;
  }
};

// One call of a worker: sends, checks, records.
void CallOnce(const LocalCellSpec& spec, LocalWorker* w, std::string* reply) {
  const Clock::time_point t0 = Clock::now();
  const local::CallStatus status = w->client->CallBytes(spec.method, *spec.payload, reply);
  const double us = Micros(Clock::now() - t0);
  if (!status.ok()) return w->Error(status.ToString());
  if (spec.expect_reply_bytes >= 0 && int64_t(reply->size()) != spec.expect_reply_bytes) {
    return w->Error("echo reply of " + std::to_string(reply->size()) + " bytes, sent " +
                    std::to_string(spec.expect_reply_bytes));
  }
  std::array<int64_t, 6> t{};
  if (spec.read_timing && !ParseTimingBytes(*reply, t.data())) {
    return w->Error("reply without a parsable timing");
  }
  ++w->ok;
  w->latency_us.push_back(us);
  w->response_bytes = int64_t(reply->size());
  if (spec.read_timing) w->timings.push_back(t);
}

void RunWorker(const LocalCellSpec& spec, LocalWorker* w, Clock::time_point end,
               std::atomic<int64_t>* completed) {
  std::string reply;
  while (w->client != nullptr && w->errors < 100) {
    CallOnce(spec, w, &reply);
    const int64_t done = ++*completed;
    const bool more = Clock::now() < end || done + int64_t(spec.concurrency) <= spec.min_requests;
    if (!more) break;
  }
}

CellResult Collect(const LocalCellSpec& spec, std::vector<LocalWorker>& workers) {
  CellResult r;
  r.target = spec.target_name;
  r.concurrency = spec.concurrency;
  r.channels = spec.concurrency;  // one connection per worker
  r.request_bytes = int64_t(spec.payload->size());
  for (const LocalWorker& w : workers) AddWorker(w, &r);
  return r;
}

}  // namespace

CellResult RunLocalCell(const LocalCellSpec& spec) {
  std::vector<LocalWorker> workers(size_t(std::max(spec.concurrency, 1)));
  for (LocalWorker& w : workers) {  // connections first: connecting is not part of the cell
    local::CallStatus error;
    w.client = local::LocalClient::Connect(spec.client, &error);
    if (w.client == nullptr) w.Error("connect: " + error.ToString());
  }
  std::atomic<int64_t> completed{0};
  const double cpu0 = CpuSeconds();
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec.duration_s));
  std::vector<std::thread> threads;
  for (LocalWorker& w : workers) {
    threads.emplace_back([&spec, &w, end, &completed] { RunWorker(spec, &w, end, &completed); });
  }
  for (std::thread& t : threads) t.join();
  CellResult r = Collect(spec, workers);
  r.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  r.cpu_s = CpuSeconds() - cpu0;
  return r;
}

}  // namespace flashserve::loadgen
