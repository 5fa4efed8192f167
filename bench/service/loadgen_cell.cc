#include "loadgen_cell.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>

#include "loadgen_shm.h"

namespace flashserve::loadgen {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace

Cell::Cell(Pool* pool, const CellSpec& spec)
    : pool_(pool), spec_(spec), master_(StaticBuffer(*spec.request)) {}

CellResult Cell::Run() {
  const int n = spec_.concurrency;
  workers_.resize(size_t(n));
  cpu0_ = CpuSeconds();
  start_ = Clock::now();
  end_ = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec_.duration_s));
  for (int i = 0; i < n; ++i) {
    workers_[size_t(i)].stub = pool_->stubs[size_t(i) % pool_->stubs.size()].get();
    Start(&workers_[size_t(i)]);
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished_ == n; });
  }
  CellResult r;
  r.wall_s = Seconds(Clock::now() - start_);
  r.cpu_s = CpuSeconds() - cpu0_;
  r.target = spec_.target_name;
  r.concurrency = n;
  r.channels = int(std::min<size_t>(size_t(n), pool_->stubs.size()));
  r.request_bytes = int64_t(spec_.request->size());
  for (const Worker& w : workers_) AddWorker(w, &r);
  return r;
}

void Cell::Start(Worker* w) {
  w->context = std::make_unique<grpc::ClientContext>();
  Authorize(w->context.get(), pool_->token);
  if (spec_.echo_response_bytes >= 0) {
    w->context->AddMetadata("x-response-bytes", std::to_string(spec_.echo_response_bytes));
  }
  w->request = master_;
  w->response.Clear();
  w->t0 = Clock::now();
  w->stub->UnaryCall(w->context.get(), spec_.method, grpc::StubOptions(), &w->request, &w->response,
                     [this, w](grpc::Status status) { Done(w, status); });
}

void Cell::Done(Worker* w, const grpc::Status& status) {
  const Clock::time_point t1 = Clock::now();
  if (status.ok()) {
    ++w->ok;
    w->latency_us.push_back(Micros(t1 - w->t0));
    w->response_bytes = int64_t(w->response.Length());
    if (spec_.read_timing) {
      std::array<int64_t, 6> t{};
      const bool parsed = spec_.kserve_timing ? ParseKServeTiming(&w->response, t.data())
                                              : ParseTiming(&w->response, t.data());
      if (parsed) w->timings.push_back(t);
    }
  } else {
    ++w->errors;
    if (w->first_error.empty()) {
      w->first_error = std::to_string(int(status.error_code())) + ": " + status.error_message();
    }
  }
  w->response.Clear();
  const int64_t done = ++completed_;
  const bool more = done < spec_.max_requests &&
                    (t1 < end_ || done + int64_t(spec_.concurrency) <= int64_t(spec_.min_requests)) &&
                    w->errors < 100;
  if (more) {
    Start(w);
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    if (++finished_ == spec_.concurrency) cv_.notify_all();
  }
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

std::vector<double> Column(const CellResult& r, int index) {
  std::vector<double> out;
  for (const auto& t : r.timings) out.push_back(double(t[size_t(index)]));
  return out;
}

std::vector<double> Overhead(const CellResult& r, bool minus_stage) {
  std::vector<double> out;
  for (const auto& t : r.timings) out.push_back(double(t[4] - t[1] - t[2] - t[3] - (minus_stage ? t[5] : 0)));
  return out;
}

}  // namespace flashserve::loadgen
