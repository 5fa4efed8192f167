// Prometheus metrics without prometheus-cpp: counters, gauges and histograms grouped in labelled
// families, rendered in the text exposition format 0.0.4.
//
//   metrics::Registry registry;
//   auto& requests = registry.AddCounter("app_requests_total", "Requests.", {"method", "status"});
//   metrics::Counter* ok = requests.Labels({"Attention", "OK"});   // keep the pointer
//   ok->Increment();                                               // one atomic add
//   std::string text = registry.Render();                          // serve with kContentType
//
// Observations are lock-free (one or two atomics); only creating a new child and rendering lock.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace flashserve::metrics {

/// The Content-Type of Registry::Render()'s output.
inline constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

/// A monotonically increasing value. Thread-safe, lock-free.
class Counter {
 public:
  /// Adds a whole number: one fetch_add.
  void Increment(uint64_t n = 1) { whole_.fetch_add(n, std::memory_order_relaxed); }
  /// Adds v >= 0 (a CAS loop); negative and NaN values are ignored, a counter never goes down.
  void Add(double v);
  double Value() const;

 private:
  std::atomic<uint64_t> whole_{0};
  std::atomic<double> fraction_{0.0};  // the non-integer increments
};

/// A value that goes up and down, or one computed at scrape time by a callback.
/// Thread-safe; Set/Add are lock-free, the callback is read under a mutex at scrape.
class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  void Increment() { Add(1.0); }
  void Decrement() { Add(-1.0); }
  /// From now on Value() returns callback() (nullptr returns to the stored value). The callback
  /// runs on the scraping thread; it must be thread-safe and must not call back into the registry.
  void SetCallback(std::function<double()> callback);
  double Value() const;

 private:
  std::atomic<double> value_{0.0};
  mutable absl::Mutex mu_;
  std::function<double()> callback_ ABSL_GUARDED_BY(mu_);
};

/// Observations counted in buckets with inclusive upper bounds (value <= le), plus their sum.
/// Thread-safe, lock-free: one fetch_add on the bucket and a CAS loop on the sum.
class Histogram {
 public:
  /// `bounds`: finite, strictly increasing upper bounds, without +Inf (always added);
  /// must outlive the histogram (the family owns it).
  explicit Histogram(const std::vector<double>& bounds);

  /// A value above the last bound (or NaN) lands only in +Inf. NaN makes the sum NaN, as in
  /// client_golang; callers that can produce NaN should filter it.
  void Observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf (== count)
    double sum = 0.0;
    uint64_t count = 0;
  };
  /// Counts are read bucket by bucket, so they are always cumulative-consistent
  /// (+Inf == count); the sum may lag the counts by in-flight observations.
  Snapshot Collect() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double>& bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds_.size() + 1, not cumulative
  std::atomic<double> sum_{0.0};
};

/// Bucket bounds 1, 2.5, 5 per decade from 1e-5 s to 10 s: 10 µs .. 10 s latencies.
std::vector<double> LatencyBuckets();
/// `count` bounds start, start*factor, ... (start > 0, factor > 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

/// Number formatting used in the exposition: "NaN", "+Inf", "-Inf", integers without a
/// fraction, otherwise the shortest text that parses back to the same double.
std::string FormatValue(double v);
/// Escapes for the text format: HELP text (\\ and \n) and label values (\\, \" and \n).
std::string EscapeHelp(std::string_view help);
std::string EscapeLabelValue(std::string_view value);

enum class MetricType { kCounter, kGauge, kHistogram };

namespace internal {
void RenderSample(const std::string& name, const std::string& labels, const Counter& c,
                  std::string* out);
void RenderSample(const std::string& name, const std::string& labels, const Gauge& g,
                  std::string* out);
void RenderSample(const std::string& name, const std::string& labels, const Histogram& h,
                  std::string* out);
/// `l1="v1",l2="v2"` with the values escaped.
std::string LabelPairs(const std::vector<std::string>& names, const std::string_view* values,
                       size_t count);
[[noreturn]] void Fatal(std::string_view message);
}  // namespace internal

/// Name, help and label names shared by the children of one family.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names);
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  /// Appends HELP, TYPE and every child's samples (children sorted by label values).
  void Render(std::string* out) const;

 protected:
  virtual void RenderSamples(std::string* out) const = 0;

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

/// The children of one metric, one per tuple of label values, created on first use and never
/// removed, so pointers returned by Labels() stay valid as long as the family. Thread-safe:
/// looking up an existing child is lock-free (a walk of an append-only list); creating one
/// takes the family's mutex. Callers on a hot path keep the pointer.
template <typename T>
class Family : public FamilyBase {
 public:
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::function<std::unique_ptr<T>()> make)
      : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
        make_(std::move(make)) {}
  ~Family() override {
    for (Node* n = head_.load(std::memory_order_acquire); n != nullptr;) {
      Node* next = n->next;
      delete n;
      n = next;
    }
  }

  /// The child for these label values (as many as label names; aborts otherwise).
  T* Labels(std::initializer_list<std::string_view> values) {
    return Get(values.begin(), values.size());
  }
  T* Labels(const std::vector<std::string_view>& values) {
    return Get(values.data(), values.size());
  }
  T* Labels(const std::vector<std::string>& values) {
    std::vector<std::string_view> views(values.begin(), values.end());
    return Get(views.data(), views.size());
  }
  /// The only child of a family without labels.
  T* Get() { return Get(nullptr, 0); }

 protected:
  void RenderSamples(std::string* out) const override {
    std::vector<const Node*> nodes;
    for (const Node* n = head_.load(std::memory_order_acquire); n != nullptr; n = n->next) {
      nodes.push_back(n);
    }
    std::sort(nodes.begin(), nodes.end(),
              [](const Node* a, const Node* b) { return a->values < b->values; });
    for (const Node* n : nodes) internal::RenderSample(name(), n->label_pairs, *n->child, out);
  }

 private:
  struct Node {
    std::vector<std::string> values;
    std::string label_pairs;
    std::unique_ptr<T> child;
    Node* next = nullptr;  // immutable once published
  };

  T* Find(const std::string_view* values, size_t count) const {
    for (const Node* n = head_.load(std::memory_order_acquire); n != nullptr; n = n->next) {
      size_t i = 0;
      while (i < count && n->values[i] == values[i]) ++i;
      if (i == count) return n->child.get();
    }
    return nullptr;
  }

  T* Get(const std::string_view* values, size_t count) {
    if (count != label_names().size()) {
      internal::Fatal(name() + ": wrong number of label values");
    }
    if (T* found = Find(values, count)) return found;
    absl::MutexLock lock(&mu_);
    if (T* found = Find(values, count)) return found;  // another thread created it meanwhile
    auto node = std::make_unique<Node>();
    node->values.assign(values, values + count);
    node->label_pairs = internal::LabelPairs(label_names(), values, count);
    node->child = make_();
    node->next = head_.load(std::memory_order_relaxed);
    T* child = node->child.get();
    head_.store(node.release(), std::memory_order_release);
    return child;
  }

  const std::function<std::unique_ptr<T>()> make_;
  absl::Mutex mu_;  // serializes creation; lookups do not take it
  std::atomic<Node*> head_{nullptr};
};

/// The set of families one endpoint exposes, rendered in registration order.
/// Thread-safe. Names must be valid Prometheus names and unique; label names must be valid, not
/// start with "__" and (for histograms) not be "le". Violations are programming errors: abort.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  Family<Counter>& AddCounter(std::string name, std::string help,
                              std::vector<std::string> label_names = {});
  Family<Gauge>& AddGauge(std::string name, std::string help,
                          std::vector<std::string> label_names = {});
  /// `bounds`: finite, strictly increasing; +Inf is implicit.
  Family<Histogram>& AddHistogram(std::string name, std::string help,
                                  std::vector<std::string> label_names, std::vector<double> bounds);

  /// The text exposition format 0.0.4 (serve it with kContentType).
  std::string Render() const;

 private:
  void Add(std::unique_ptr<FamilyBase> family);

  mutable absl::Mutex mu_;
  // Histogram bounds, declared first so they outlive the families that point at them.
  std::vector<std::unique_ptr<std::vector<double>>> bounds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flashserve::metrics
