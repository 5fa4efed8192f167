#include "metrics/metrics.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

namespace flashserve::metrics {
namespace {

// Adds v to an atomic double (std::atomic<double>::fetch_add is C++20).
void AtomicAdd(std::atomic<double>& target, double v) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + v, std::memory_order_relaxed)) {
  }
}

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsNameChar(char c) { return IsNameStart(c) || (c >= '0' && c <= '9'); }

bool ValidMetricName(std::string_view name) {
  if (name.empty() || !(IsNameStart(name[0]) || name[0] == ':')) return false;
  for (char c : name) {
    if (!IsNameChar(c) && c != ':') return false;
  }
  return true;
}

bool ValidLabelName(std::string_view name) {
  if (name.empty() || !IsNameStart(name[0]) || name.substr(0, 2) == "__") return false;
  for (char c : name) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendSample(std::string* out, const std::string& name, std::string_view suffix,
                  const std::string& labels, std::string_view value) {
  out->append(name).append(suffix);
  if (!labels.empty()) out->append("{").append(labels).append("}");
  out->append(" ").append(value).append("\n");
}

}  // namespace

// --- Counter, Gauge, Histogram ------------------------------------------------------------------

void Counter::Add(double v) {
  if (!(v >= 0.0)) return;  // negative or NaN
  // Whole increments stay exact in the integer part however large the total grows.
  if (v == std::floor(v) && v < 9.0e18) {
    Increment(uint64_t(v));
  } else {
    AtomicAdd(fraction_, v);
  }
}

double Counter::Value() const {
  return double(whole_.load(std::memory_order_relaxed)) + fraction_.load(std::memory_order_relaxed);
}

void Gauge::Add(double v) { AtomicAdd(value_, v); }

void Gauge::SetCallback(std::function<double()> callback) {
  absl::MutexLock lock(&mu_);
  callback_ = std::move(callback);
}

double Gauge::Value() const {
  absl::MutexLock lock(&mu_);
  if (callback_) return callback_();
  return value_.load(std::memory_order_relaxed);
}

Histogram::Histogram(const std::vector<double>& bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  // First bound >= v: buckets are "le", inclusive. NaN compares false with everything: +Inf.
  const size_t bucket =
      std::isnan(v) ? bounds_.size()
                    : size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot s;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = total;
  }
  s.count = total;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> LatencyBuckets() {
  // Literals, not products, so every bound prints as written ("2.5e-05", not
  // "2.5000000000000002e-05").
  return {1e-5,   2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
          2.5e-2, 5e-2,   0.1,  0.25, 0.5,    1.0,  2.5,  5.0,    10.0};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0.0) || !(factor > 1.0) || count < 1) {
    internal::Fatal("ExponentialBuckets: need start > 0, factor > 1, count >= 1");
  }
  std::vector<double> bounds;
  bounds.reserve(size_t(count));
  for (double b = start; int(bounds.size()) < count; b *= factor) bounds.push_back(b);
  return bounds;
}

// --- text format ---------------------------------------------------------------------------------

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    const auto r = std::to_chars(buf, buf + sizeof(buf), int64_t(v));
    return std::string(buf, r.ptr);
  }
  // Shortest round-trip digits; exponent form only for very small or large magnitudes, as Go's
  // strconv.FormatFloat(v, 'g', -1, 64) does (what Prometheus' own client prints).
  const auto sci = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  const std::string scientific(buf, sci.ptr);
  const int exponent = std::atoi(scientific.c_str() + scientific.find('e') + 1);
  if (exponent < -4 || exponent >= 21) return scientific;
  const auto fixed = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  return std::string(buf, fixed.ptr);
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

namespace internal {

void Fatal(std::string_view message) {
  std::fprintf(stderr, "flashserve metrics: %.*s\n", int(message.size()), message.data());
  std::abort();
}

std::string LabelPairs(const std::vector<std::string>& names, const std::string_view* values,
                       size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) out += ',';
    out.append(names[i]).append("=\"").append(EscapeLabelValue(values[i])).append("\"");
  }
  return out;
}

void RenderSample(const std::string& name, const std::string& labels, const Counter& c,
                  std::string* out) {
  AppendSample(out, name, "", labels, FormatValue(c.Value()));
}

void RenderSample(const std::string& name, const std::string& labels, const Gauge& g,
                  std::string* out) {
  AppendSample(out, name, "", labels, FormatValue(g.Value()));
}

void RenderSample(const std::string& name, const std::string& labels, const Histogram& h,
                  std::string* out) {
  const Histogram::Snapshot s = h.Collect();
  const std::string prefix = labels.empty() ? std::string() : labels + ",";
  const std::vector<double>& bounds = h.bounds();
  for (size_t i = 0; i <= bounds.size(); ++i) {
    const std::string le = i < bounds.size() ? FormatValue(bounds[i]) : "+Inf";
    AppendSample(out, name, "_bucket", prefix + "le=\"" + le + "\"",
                 std::to_string(s.cumulative[i]));
  }
  AppendSample(out, name, "_sum", labels, FormatValue(s.sum));
  AppendSample(out, name, "_count", labels, std::to_string(s.count));
}

}  // namespace internal

// --- families and the registry -------------------------------------------------------------------

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)) {
  if (!ValidMetricName(name_)) internal::Fatal("invalid metric name '" + name_ + "'");
  for (const std::string& label : label_names_) {
    if (!ValidLabelName(label) || (type_ == MetricType::kHistogram && label == "le")) {
      internal::Fatal(name_ + ": invalid label name '" + label + "'");
    }
  }
}

void FamilyBase::Render(std::string* out) const {
  out->append("# HELP ").append(name_).append(" ").append(EscapeHelp(help_)).append("\n");
  out->append("# TYPE ").append(name_).append(" ").append(TypeName(type_)).append("\n");
  RenderSamples(out);
}

Family<Counter>& Registry::AddCounter(std::string name, std::string help,
                                      std::vector<std::string> label_names) {
  auto family = std::make_unique<Family<Counter>>(std::move(name), std::move(help),
                                                  MetricType::kCounter, std::move(label_names),
                                                  [] { return std::make_unique<Counter>(); });
  Family<Counter>& ref = *family;
  Add(std::move(family));
  return ref;
}

Family<Gauge>& Registry::AddGauge(std::string name, std::string help,
                                  std::vector<std::string> label_names) {
  auto family = std::make_unique<Family<Gauge>>(std::move(name), std::move(help),
                                                MetricType::kGauge, std::move(label_names),
                                                [] { return std::make_unique<Gauge>(); });
  Family<Gauge>& ref = *family;
  Add(std::move(family));
  return ref;
}

Family<Histogram>& Registry::AddHistogram(std::string name, std::string help,
                                          std::vector<std::string> label_names,
                                          std::vector<double> bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      internal::Fatal(name + ": bucket bounds must be finite and strictly increasing");
    }
  }
  auto owned = std::make_unique<std::vector<double>>(std::move(bounds));
  const std::vector<double>* b = owned.get();
  auto family = std::make_unique<Family<Histogram>>(
      std::move(name), std::move(help), MetricType::kHistogram, std::move(label_names),
      [b] { return std::make_unique<Histogram>(*b); });
  Family<Histogram>& ref = *family;
  {
    absl::MutexLock lock(&mu_);
    bounds_.push_back(std::move(owned));
  }
  Add(std::move(family));
  return ref;
}

void Registry::Add(std::unique_ptr<FamilyBase> family) {
  absl::MutexLock lock(&mu_);
  for (const auto& existing : families_) {
    if (existing->name() == family->name()) {
      internal::Fatal("metric '" + family->name() + "' registered twice");
    }
  }
  families_.push_back(std::move(family));
}

std::string Registry::Render() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& family : families_) family->Render(&out);
  return out;
}

}  // namespace flashserve::metrics
