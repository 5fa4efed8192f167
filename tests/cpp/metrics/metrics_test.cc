// The metric primitives and the text exposition format 0.0.4.
#include "metrics/metrics.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve::metrics {
namespace {

std::vector<uint64_t> Cumulative(const Histogram& h) { return h.Collect().cumulative; }

TEST(HistogramTest, ValueOnABoundGoesIntoThatBucket) {
  const std::vector<double> bounds = {1.0, 2.0, 5.0};
  Histogram h(bounds);
  h.Observe(1.0);
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{1, 1, 1, 1}));
  h.Observe(2.0);
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{1, 2, 2, 2}));
  h.Observe(5.0);
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{1, 2, 3, 3}));
}

TEST(HistogramTest, JustAboveABoundGoesIntoTheNextBucket) {
  const std::vector<double> bounds = {1.0, 2.0};
  Histogram h(bounds);
  h.Observe(std::nextafter(1.0, 2.0));
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{0, 1, 1}));
}

TEST(HistogramTest, BelowTheFirstBoundAndNegativeGoIntoTheFirstBucket) {
  const std::vector<double> bounds = {1e-5, 1.0};
  Histogram h(bounds);
  h.Observe(0.0);
  h.Observe(-3.0);
  h.Observe(9e-6);
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{3, 3, 3}));
}

TEST(HistogramTest, AboveTheLastBoundCountsOnlyInPlusInf) {
  const std::vector<double> bounds = {1.0, 10.0};
  Histogram h(bounds);
  h.Observe(10.5);
  h.Observe(std::numeric_limits<double>::infinity());
  const Histogram::Snapshot s = h.Collect();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{0, 0, 2}));
  EXPECT_EQ(s.count, 2u);
}

TEST(HistogramTest, NaNCountsOnlyInPlusInf) {
  const std::vector<double> bounds = {1.0};
  Histogram h(bounds);
  h.Observe(std::nan(""));
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{0, 1}));
  EXPECT_TRUE(std::isnan(h.Collect().sum));
}

TEST(HistogramTest, CountsAreCumulativeAndSumIsExact) {
  const std::vector<double> bounds = {0.25, 0.5, 1.0, 2.0};
  Histogram h(bounds);
  for (double v : {0.125, 0.25, 0.375, 0.75, 0.75, 1.5, 4.0}) h.Observe(v);
  const Histogram::Snapshot s = h.Collect();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 3, 5, 6, 7}));
  EXPECT_EQ(s.count, 7u);
  EXPECT_EQ(s.sum, 0.125 + 0.25 + 0.375 + 0.75 + 0.75 + 1.5 + 4.0);
}

TEST(BucketsTest, LatencyBucketsSpan10MicrosecondsTo10Seconds) {
  const std::vector<double> b = LatencyBuckets();
  ASSERT_EQ(b.size(), 19u);
  EXPECT_EQ(b.front(), 1e-5);
  EXPECT_EQ(b.back(), 10.0);
  for (size_t i = 1; i < b.size(); ++i) EXPECT_LT(b[i - 1], b[i]);
  std::vector<std::string> text;
  for (double v : b) text.push_back(FormatValue(v));
  EXPECT_EQ(text, (std::vector<std::string>{"1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025",
                                            "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025",
                                            "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10"}));
}

TEST(BucketsTest, ExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(1.0, 2.0, 4), (std::vector<double>{1, 2, 4, 8}));
}

TEST(FormatTest, SpecialValuesAndIntegers) {
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(0.0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(1.0), "1");
  EXPECT_EQ(FormatValue(-42.0), "-42");
  EXPECT_EQ(FormatValue(123456789012.0), "123456789012");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatValue(1.5e-7), "1.5e-07");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::max()), "1.7976931348623157e+308");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::denorm_min()), "5e-324");
}

TEST(FormatTest, ShortestTextRoundTrips) {
  std::mt19937_64 rng(20240601);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-300, 300);
  for (int i = 0; i < 100000; ++i) {
    const double v = std::ldexp(mantissa(rng), exponent(rng));
    const std::string text = FormatValue(v);
    ASSERT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
    ASSERT_LE(text.size(), 24u) << text;
  }
}

TEST(EscapeTest, LabelValues) {
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeLabelValue("tab\tand utf-8 \xc2\xb5s"), "tab\tand utf-8 \xc2\xb5s");
}

TEST(EscapeTest, HelpEscapesBackslashAndNewlineButNotQuotes) {
  EXPECT_EQ(EscapeHelp("two\nlines, a \\ and \"quotes\""), "two\\nlines, a \\\\ and \"quotes\"");
}

TEST(RenderTest, EscapedLabelValueAndHelpInTheExposition) {
  Registry registry;
  auto& family = registry.AddCounter("x_total", "Help with \\ and\nnewline.", {"path"});
  family.Labels({"C:\\dir\n\"q\""})->Increment();
  EXPECT_EQ(registry.Render(),
            "# HELP x_total Help with \\\\ and\\nnewline.\n"
            "# TYPE x_total counter\n"
            "x_total{path=\"C:\\\\dir\\n\\\"q\\\"\"} 1\n");
}

TEST(RenderTest, GoldenExposition) {
  Registry registry;
  auto& requests = registry.AddCounter("app_requests_total", "Requests.", {"method", "status"});
  auto& temperature = registry.AddGauge("app_temperature_celsius", "Temperature.");
  auto& latency =
      registry.AddHistogram("app_latency_seconds", "Latency.", {"method"}, {0.001, 0.25, 1});
  auto& empty = registry.AddGauge("app_unused", "Declared, never set.", {"x"});
  (void)empty;

  requests.Labels({"Get", "OK"})->Increment(3);
  requests.Labels({"Attention", "OK"})->Increment();
  requests.Labels({"Attention", "INVALID_ARGUMENT"})->Add(2.0);
  temperature.Get()->Set(-1.5);
  latency.Labels({"Attention"})->Observe(0.001);  // on a bound: le="0.001"
  latency.Labels({"Attention"})->Observe(0.125);
  latency.Labels({"Attention"})->Observe(3.0);  // above the last bound: only +Inf
  latency.Labels({"Get"})->Observe(0.5);

  const std::string expected =
      "# HELP app_requests_total Requests.\n"
      "# TYPE app_requests_total counter\n"
      "app_requests_total{method=\"Attention\",status=\"INVALID_ARGUMENT\"} 2\n"
      "app_requests_total{method=\"Attention\",status=\"OK\"} 1\n"
      "app_requests_total{method=\"Get\",status=\"OK\"} 3\n"
      "# HELP app_temperature_celsius Temperature.\n"
      "# TYPE app_temperature_celsius gauge\n"
      "app_temperature_celsius -1.5\n"
      "# HELP app_latency_seconds Latency.\n"
      "# TYPE app_latency_seconds histogram\n"
      "app_latency_seconds_bucket{method=\"Attention\",le=\"0.001\"} 1\n"
      "app_latency_seconds_bucket{method=\"Attention\",le=\"0.25\"} 2\n"
      "app_latency_seconds_bucket{method=\"Attention\",le=\"1\"} 2\n"
      "app_latency_seconds_bucket{method=\"Attention\",le=\"+Inf\"} 3\n"
      "app_latency_seconds_sum{method=\"Attention\"} 3.126\n"
      "app_latency_seconds_count{method=\"Attention\"} 3\n"
      "app_latency_seconds_bucket{method=\"Get\",le=\"0.001\"} 0\n"
      "app_latency_seconds_bucket{method=\"Get\",le=\"0.25\"} 0\n"
      "app_latency_seconds_bucket{method=\"Get\",le=\"1\"} 1\n"
      "app_latency_seconds_bucket{method=\"Get\",le=\"+Inf\"} 1\n"
      "app_latency_seconds_sum{method=\"Get\"} 0.5\n"
      "app_latency_seconds_count{method=\"Get\"} 1\n"
      "# HELP app_unused Declared, never set.\n"
      "# TYPE app_unused gauge\n";
  EXPECT_EQ(registry.Render(), expected);
}

TEST(RenderTest, UnlabelledHistogram) {
  Registry registry;
  registry.AddHistogram("h", "H.", {}, {1}).Get()->Observe(0.5);
  EXPECT_EQ(registry.Render(),
            "# HELP h H.\n# TYPE h histogram\n"
            "h_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.5\nh_count 1\n");
}

TEST(FamilyTest, ChildrenAreCachedPerLabelTuple) {
  Registry registry;
  auto& family = registry.AddCounter("c_total", "C.", {"a", "b"});
  Counter* first = family.Labels({"x", "y"});
  EXPECT_EQ(family.Labels({"x", "y"}), first);
  EXPECT_EQ(family.Labels(std::vector<std::string>{"x", "y"}), first);
  EXPECT_NE(family.Labels({"y", "x"}), first);
  EXPECT_NE(family.Labels({"x", ""}), first);
  first->Increment();
  EXPECT_EQ(family.Labels({"x", "y"})->Value(), 1.0);
}

TEST(FamilyTest, ConcurrentFirstUseCreatesOneChild) {
  Registry registry;
  auto& family = registry.AddCounter("c_total", "C.", {"k"});
  constexpr int kThreads = 8;
  std::vector<Counter*> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        Counter* c = family.Labels({std::to_string(i % 50)});
        c->Increment();
        if (i == 7) seen[size_t(t)] = c;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (Counter* c : seen) EXPECT_EQ(c, seen[0]);
  EXPECT_EQ(family.Labels({"7"})->Value(), kThreads * 20.0);
  const std::string text = registry.Render();
  size_t samples = 0;
  for (size_t pos = 0; (pos = text.find("c_total{", pos)) != std::string::npos; ++pos) ++samples;
  EXPECT_EQ(samples, 50u);
}

TEST(ConcurrencyTest, ManyThreadsObserveExactly) {
  Registry registry;
  auto& hist = registry.AddHistogram("h", "H.", {"m"}, {0.25, 0.5, 1.0});
  auto& counter = registry.AddCounter("c_total", "C.");
  auto& gauge = registry.AddGauge("g", "G.");
  Histogram* h = hist.Labels({"Attention"});
  Counter* c = counter.Get();
  Gauge* g = gauge.Get();
  constexpr int kThreads = 8;
  constexpr int kPerThread = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([=] {
      // Binary fractions: every partial sum is exact, so the total must be too.
      const double values[4] = {0.125, 0.5, 0.75, 2.0};
      for (int i = 0; i < kPerThread; ++i) {
        h->Observe(values[(i + t) % 4]);
        c->Increment();
        c->Add(0.5);
        g->Increment();
        g->Add(-0.5);
      }
    });
  }
  for (auto& th : threads) th.join();
  const Histogram::Snapshot s = h->Collect();
  constexpr uint64_t kTotal = uint64_t(kThreads) * kPerThread;
  EXPECT_EQ(s.count, kTotal);
  EXPECT_EQ(s.sum, double(kTotal / 4) * (0.125 + 0.5 + 0.75 + 2.0));
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{kTotal / 4, kTotal / 2, kTotal * 3 / 4, kTotal}));
  EXPECT_EQ(c->Value(), double(kTotal) * 1.5);
  EXPECT_EQ(g->Value(), double(kTotal) * 0.5);
}

TEST(CounterTest, NeverDecreases) {
  Counter c;
  c.Add(-1.0);
  c.Add(std::nan(""));
  c.Add(0.25);
  c.Increment(2);
  EXPECT_EQ(c.Value(), 2.25);
}

TEST(GaugeTest, CallbackIsReadAtScrapeAndCanBeCleared) {
  Registry registry;
  Gauge* g = registry.AddGauge("depth", "D.").Get();
  g->Set(3);
  double source = 7;
  g->SetCallback([&source] { return source; });
  EXPECT_EQ(g->Value(), 7.0);
  source = 9;
  EXPECT_EQ(registry.Render(), "# HELP depth D.\n# TYPE depth gauge\ndepth 9\n");
  g->SetCallback(nullptr);
  EXPECT_EQ(g->Value(), 3.0);
}

using MetricsDeathTest = ::testing::Test;

TEST(MetricsDeathTest, ProgrammingErrorsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("c_total", "C.", {"a"}).Labels({"x", "y"});
      },
      "wrong number of label values");
  EXPECT_DEATH(Registry().AddCounter("bad-name", "B."), "invalid metric name");
  EXPECT_DEATH(Registry().AddCounter("c", "C.", {"__reserved"}), "invalid label name");
  EXPECT_DEATH(Registry().AddHistogram("h", "H.", {"le"}, {1}), "invalid label name");
  EXPECT_DEATH(Registry().AddHistogram("h", "H.", {}, {2, 1}), "strictly increasing");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddGauge("g", "G.");
        r.AddGauge("g", "G.");
      },
      "registered twice");
}

}  // namespace
}  // namespace flashserve::metrics
