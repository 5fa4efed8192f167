// GET /metrics over HTTP.
#include "metrics/metrics_http.h"

#include "gtest/gtest.h"
#include "httplib.h"

namespace flashserve {
namespace {

MetricsHttpOptions LocalOptions(int port) {
  MetricsHttpOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.threads = 1;
  return options;
}

TEST(MetricsHttpTest, ServesTheExpositionOnAFreePort) {
  ServerMetrics metrics;
  metrics.RecordRequest("Attention", "OK", 0.01, 100, 50);
  MetricsHttpOptions options;
  options.port = 0;
  auto server = MetricsHttpServer::Create(options, &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  httplib::Client client("127.0.0.1", (*server)->port());
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(res->body, metrics.Render());
  EXPECT_NE(res->body.find("flashserve_requests_total{method=\"Attention\",status=\"OK\"} 1\n"),
            std::string::npos);

  auto head = client.Head("/metrics");
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);

  for (const char* path : {"/", "/metrics/", "/v2/health/live", "/metricsx"}) {
    auto other = client.Get(path);
    ASSERT_TRUE(other) << path;
    EXPECT_EQ(other->status, 404) << path;
  }
  (*server)->Stop();
  (*server)->Stop();  // idempotent
  EXPECT_FALSE(client.Get("/metrics"));
}

TEST(MetricsHttpTest, StopRightAfterCreateDoesNotHang) {
  ServerMetrics metrics;
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsHttpServer::Create(LocalOptions(0), &metrics);
    ASSERT_TRUE(server.ok()) << server.status();
    (*server)->Stop();
  }
}

TEST(MetricsHttpTest, PortInUseIsUnavailable) {
  ServerMetrics metrics;
  auto first = MetricsHttpServer::Create(LocalOptions(0), &metrics);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsHttpServer::Create(LocalOptions((*first)->port()), &metrics);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST(MetricsHttpTest, NoMetricsIsAnError) {
  EXPECT_FALSE(MetricsHttpServer::Create(LocalOptions(0), nullptr).ok());
}

}  // namespace
}  // namespace flashserve
