// flashserve-loadgen: the service benchmark (issue 9).
//
// Closed-loop load over gRPC's callback API: `concurrency` requests in flight, each worker on its own
// channel (one HTTP/2 connection per worker unless --channels says otherwise), the request serialized
// once and re-sent as the same ByteBuffer (reference counted slices: the load generator copies
// nothing per call). Each response is checked (status, size) and its server timing is read by
// skipping over the tensor bytes, so the client stays cheap. For each request shape and concurrency:
//   * flashserve (AttentionService/Attention): p50/p99 latency, throughput, goodput, the server's
//     timing breakdown and server overhead = total - h2d - compute - d2h;
//   * the raw ceiling: the same request bytes to flashserve-echo, which answers with as many bytes as
//     flashserve's response had, same client, same channel settings;
//   * the load generator's own ceiling: tiny echo calls (calls/s) and its CPU use per cell;
//   * the striped streaming path (AttentionStreamService) at concurrency 1 with K channels.
// Writes a CSV (one row per cell) and markdown tables.
//
// The flags: kUsage below (--help prints it).
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "flashserve/v1/attention.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "loadgen_cell.h"
#include "loadgen_format.h"
#include "loadgen_local.h"
#include "loadgen_shm.h"
#include "loadgen_striped.h"
#include "loadgen_workload.h"

namespace {

using flashserve::loadgen::Cell;
using flashserve::loadgen::CellResult;
using flashserve::loadgen::CellSpec;
using flashserve::loadgen::Clock;
using flashserve::loadgen::Column;
using flashserve::loadgen::Fmt;
using flashserve::loadgen::kShapes;
using flashserve::loadgen::MakeChannel;
using flashserve::loadgen::MakeWorkload;
using flashserve::loadgen::Micros;
using flashserve::loadgen::Overhead;
using flashserve::loadgen::Percentile;
using flashserve::loadgen::Pool;
using flashserve::loadgen::RunStriped;
using flashserve::loadgen::Shape;
using flashserve::loadgen::StripedSample;
using flashserve::loadgen::Workload;
namespace v1 = flashserve::v1;

// --- flags --------------------------------------------------------------------------------------

constexpr char kUsage[] =
    "usage: flashserve-loadgen [--name=value ...]\n"
    "  --target=HOST:PORT            flashserve's gRPC address (default 127.0.0.1:8001)\n"
    "  --echo=HOST:PORT              flashserve-echo: the raw gRPC ceiling (default none)\n"
    "  --token=T                     bearer token for a server started with --auth_token_file (or\n"
    "                                $FLASHSERVE_AUTH_TOKEN): sent on every gRPC call (unary grid, "
    "striped,\n"
    "                                shared-memory registrations and ModelInfer; the echo calls "
    "carry it\n"
    "                                too, so both carry the same bytes) and in the local socket's "
    "Hello\n"
    "  --shapes=small,medium,large   request shapes\n"
    "  --concurrency=1,4,16,64       requests in flight per cell\n"
    "  --duration_s=2  --min_requests=3  --large_max_concurrency=16\n"
    "  --channels=0                  channels (connections) in the pool; 0: one per worker\n"
    "  --stripes=1,2,4,8  --stripe_reps=5  --striped_shapes=medium,large  --chunk_mib=4\n"
    "                                the striped streaming path (--stripes= skips it)\n"
    "  --csv=service.csv  --md=service.md   where the tables go\n"
    "  --shm=system,cuda  --shm_device=0    shared-memory paths over KServe gRPC (loadgen_shm.h;\n"
    "                                the server needs --allow_client_shm; cuda: CUDA builds only)\n"
    "  --local_socket=PATH           the local transport's cells (loadgen_local.h; the server "
    "needs\n"
    "                                --local_socket=PATH)\n"
    "  --local_shm=system,cuda       their shm paths (default those of --shm)\n"
    "  --local_max_frame_bytes=8388608\n"
    "  --client_spin_us=0            local cells: each client polls this long (us) for its reply\n"
    "                                before blocking in recv (local_client.h)\n";

const std::set<std::string> kKnownFlags = {
    "target",        "echo",         "token",        "shapes",
    "concurrency",   "duration_s",   "min_requests", "large_max_concurrency",
    "channels",      "stripes",      "stripe_reps",  "striped_shapes",
    "chunk_mib",     "csv",          "md",           "shm",
    "shm_device",    "local_socket", "local_shm",    "local_max_frame_bytes",
    "client_spin_us"};

// --- options ------------------------------------------------------------------------------------

struct Options {
  std::string target, echo, token, csv_path, md_path;
  double duration = 2;
  int min_requests = 3, large_max_conc = 16, stripe_reps = 5, pool_size = 1, shm_device = 0;
  int64_t chunk_bytes = 4 << 20;
  uint64_t local_max_frame_bytes = 0;
  int64_t client_spin_us = 0;
  std::vector<int> concurrency, stripes;
  std::vector<std::string> shapes, striped_shapes, shm_paths, local_shm;
  std::string local_socket;
};

Options ParseOptions(int argc, char** argv) {
  const flashserve::bench::Flags flags(argc, argv, kUsage, kKnownFlags);
  Options o;
  o.target = flags.Str("target", "127.0.0.1:8001");
  o.echo = flags.Str("echo", "");
  o.token = flags.Str("token", "");
  o.csv_path = flags.Str("csv", "service.csv");
  o.md_path = flags.Str("md", "service.md");
  o.duration = flags.Double("duration_s", 2);
  o.min_requests = int(flags.Int("min_requests", 3));
  o.large_max_conc = int(flags.Int("large_max_concurrency", 16));
  o.stripe_reps = int(flags.Int("stripe_reps", 5));
  o.chunk_bytes = int64_t(flags.Double("chunk_mib", 4) * (1 << 20));
  o.concurrency = flags.IntList("concurrency", "1,4,16,64");
  o.stripes = flags.IntList("stripes", "1,2,4,8");
  o.shapes = flags.List("shapes", "small,medium,large");
  o.striped_shapes = flags.List("striped_shapes", "medium,large");
  o.shm_paths = flags.List("shm", "");
  o.shm_device = int(flags.Int("shm_device", 0));
  o.local_socket = flags.Str("local_socket", "");
  o.local_shm = flags.List("local_shm", flags.Str("shm", ""));
  o.local_max_frame_bytes = uint64_t(flags.Int(
      "local_max_frame_bytes", int64_t(flashserve::loadgen::LocalSectionOptions{}.max_frame_bytes)));
  const auto positive = [](int v) { return v >= 1; };
  if (o.concurrency.empty() || !std::all_of(o.concurrency.begin(), o.concurrency.end(), positive)) {
    flags.Fail("--concurrency: one or more levels, each >= 1");
  }
  if (!std::all_of(o.stripes.begin(), o.stripes.end(), positive)) {
    flags.Fail("--stripes: each >= 1");
  }
  // The server's DownloadRequest.chunk_bytes range (the same size serves uploads and downloads).
  if (o.chunk_bytes < 4096 || o.chunk_bytes > (int64_t{64} << 20))
    flags.Fail("--chunk_mib: 4 KiB .. 64 MiB (0.00390625 .. 64)");
  for (const std::string& name : o.shapes) {
    const bool known = std::any_of(kShapes.begin(), kShapes.end(),
                                   [&](const Shape& s) { return s.name == name; });
    if (!known) flags.Fail("--shapes: unknown shape " + name);
  }
  if (flags.Int("local_max_frame_bytes", 1) < 1) flags.Fail("--local_max_frame_bytes: >= 1");
  o.client_spin_us = flags.Int("client_spin_us", 0);
  if (o.client_spin_us < 0 || o.client_spin_us > 1000000) {
    flags.Fail("--client_spin_us: in [0, 1000000]");
  }
  const int channels = int(flags.Int("channels", 0));
  o.pool_size = channels > 0 ? channels
                             : *std::max_element(o.concurrency.begin(), o.concurrency.end());
  return o;
}

// --- the unary grid -----------------------------------------------------------------------------

constexpr char kAttention[] = "/flashserve.v1.AttentionService/Attention";
constexpr char kEcho[] = "/flashserve.bench.Echo/Echo";

constexpr char kCsvHeader[] =
    "target,shape,concurrency,channels,ok,errors,wall_s,req_per_s,p50_us,p99_us,request_bytes,"
    "response_bytes,goodput_p50_GBps,goodput_agg_GBps,queue_p50_us,h2d_p50_us,compute_p50_us,"
    "d2h_p50_us,total_p50_us,overhead_p50_us,overhead_p99_us,client_cpu_cores,first_error,"
    "stage_p50_us,overhead_excl_stage_p50_us\n";

void WriteCsvRow(std::ofstream& csv, const CellResult& x) {
  const double b = double(x.request_bytes + x.response_bytes);
  csv << x.target << ',' << x.shape << ',' << x.concurrency << ',' << x.channels << ',' << x.ok
      << ',' << x.errors << ',' << x.wall_s << ',' << double(x.ok) / x.wall_s << ','
      << Percentile(x.latency_us, 0.5) << ',' << Percentile(x.latency_us, 0.99) << ','
      << x.request_bytes << ',' << x.response_bytes << ','
      << b / (Percentile(x.latency_us, 0.5) * 1e3) << ',' << b * double(x.ok) / x.wall_s / 1e9
      << ',' << Percentile(Column(x, 0), 0.5) << ',' << Percentile(Column(x, 1), 0.5) << ','
      << Percentile(Column(x, 2), 0.5) << ',' << Percentile(Column(x, 3), 0.5) << ','
      << Percentile(Column(x, 4), 0.5) << ',' << Percentile(Overhead(x), 0.5) << ','
      << Percentile(Overhead(x), 0.99) << ',' << x.cpu_s / x.wall_s << ",\"" << x.first_error
      << "\"," << Percentile(Column(x, 5), 0.5) << ',' << Percentile(Overhead(x, true), 0.5)
      << "\n";
}

// The load generator's own ceiling: tiny calls to the echo server.
void EchoCeilingSection(Pool* echo_pool, const Options& opt, std::ostringstream& md) {
  md << "### Load generator ceiling (tiny echo calls, 64 B each way)\n\n"
        "| concurrency | calls/s | p50 us | p99 us | client CPU cores |\n|---|---|---|---|---|\n";
  const std::string tiny(64, 'x');
  for (int c : opt.concurrency) {
    CellSpec spec{"echo-tiny", kEcho, &tiny, 64, c, opt.duration, opt.min_requests, 1 << 30, false};
    CellResult r = Cell(echo_pool, spec).Run();
    md << Fmt("| %d | %.0f | %.0f | %.0f | %.2f |\n", c, double(r.ok) / r.wall_s,
              Percentile(r.latency_us, 0.5), Percentile(r.latency_us, 0.99), r.cpu_s / r.wall_s);
  }
  md << "\n";
}

// Warm-up of one shape (first CUDA use of it, connection windows); its response size, or -1 when
// the server refused it.
int64_t WarmUpShape(Pool* server, Pool* echo_pool, const Workload& w) {
  CellSpec first{"flashserve", kAttention, &w.serialized, -1, 1, 0, 2, 2, true};
  CellResult r = Cell(server, first).Run();
  if (r.ok == 0) {
    std::fprintf(stderr, "warm-up failed: %s\n", r.first_error.c_str());
    return -1;
  }
  // Both targets then get the same unmeasured second of this shape on the first channel (the one
  // c=1 cells use): HTTP/2 flow-control windows grow with the bytes a connection has carried (BDP
  // probing), and a channel that has only seen small requests starts a medium one cold -- which
  // used to favour whichever target went second.
  CellSpec warm{"flashserve", kAttention, &w.serialized, -1, 1, 1.0, 2, 1 << 30, false};
  Cell(server, warm).Run();
  if (echo_pool != nullptr) {
    CellSpec ewarm{"echo", kEcho, &w.serialized, r.response_bytes, 1, 1.0, 2, 1 << 30, false};
    Cell(echo_pool, ewarm).Run();
  }
  return r.response_bytes;
}

// Response parse cost on the client (one AttentionResponse of that size), for the breakdown.
double ResponseParseUs(const Workload& w) {
  v1::AttentionResponse resp;
  resp.mutable_out()->set_dtype(v1::BFLOAT16);
  *resp.mutable_out()->mutable_data() = w.request.q().data();
  const std::string bytes = resp.SerializeAsString();
  v1::AttentionResponse back;
  const auto t0 = Clock::now();
  back.ParseFromString(bytes);
  return Micros(Clock::now() - t0);
}

// Where the report of one shape goes.
struct Report {
  std::ofstream& csv;
  std::ostringstream& md;
  std::ostringstream& breakdown;
};

void WriteUnaryRows(const Report& out, const Workload& w, int c, const CellResult& r,
                    const CellResult* e, double response_parse_us) {
  const std::string& name = w.shape.name;
  const double bytes = double(r.request_bytes + r.response_bytes);
  const double p50 = Percentile(r.latency_us, 0.5);
  const double agg = bytes * double(r.ok) / r.wall_s / 1e9;
  const double eagg = e != nullptr ? bytes * double(e->ok) / e->wall_s / 1e9 : 0;
  const double ep50 = e != nullptr ? Percentile(e->latency_us, 0.5) : 0.0;
  out.md << Fmt(
      "| %s | %d | %.1f | %.3f | %.3f | %.2f | %.2f | %.3f | %.2f | %.2f | %.2f | %.0f | %.0f | "
      "%.0f | %.0f | %.0f | %.0f | %.2f | %lld |\n",
      name.c_str(), c, double(r.ok) / r.wall_s, p50 / 1e3, Percentile(r.latency_us, 0.99) / 1e3,
      bytes / (p50 * 1e3), agg, ep50 / 1e3, eagg, ep50 > 0 ? ep50 / p50 : 0.0,
      eagg > 0 ? agg / eagg : 0.0, Percentile(Overhead(r), 0.5), Percentile(Column(r, 5), 0.5),
      Percentile(Overhead(r, true), 0.5), Percentile(Column(r, 1), 0.5),
      Percentile(Column(r, 2), 0.5), Percentile(Column(r, 3), 0.5), r.cpu_s / r.wall_s,
      (long long)(r.errors));
  std::fprintf(stderr, "%s c=%d: %lld ok %lld err, p50 %.3f ms, agg %.2f GB/s (echo %.2f) %s\n",
               name.c_str(), c, (long long)r.ok, (long long)r.errors, p50 / 1e3, agg, eagg,
               r.first_error.c_str());
  if (c != 1) return;
  const double total_ms = Percentile(Column(r, 4), 0.5) / 1e3;
  const double echo_ms = ep50 / 1e3;
  out.breakdown << Fmt(
      "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f |\n",
      name.c_str(), p50 / 1e3, echo_ms, total_ms, Percentile(Column(r, 5), 0.5) / 1e3,
      Percentile(Column(r, 0), 0.5) / 1e3, Percentile(Column(r, 1), 0.5) / 1e3,
      Percentile(Column(r, 2), 0.5) / 1e3, Percentile(Column(r, 3), 0.5) / 1e3,
      (Percentile(Overhead(r, true), 0.5) - Percentile(Column(r, 0), 0.5)) / 1e3,
      p50 / 1e3 - total_ms - echo_ms, w.serialize_us / 1e3, response_parse_us / 1e3);
}

// Every concurrency level of one shape: flashserve, then the echo of the same bytes; false when
// the shape's warm-up failed.
bool UnaryShape(Pool* server, Pool* echo_pool, const Options& opt, const Workload& w,
                const Report& out) {
  const int64_t response_bytes = WarmUpShape(server, echo_pool, w);
  if (response_bytes < 0) return false;
  const double response_parse_us = ResponseParseUs(w);
  for (int c : opt.concurrency) {
    if (w.shape.name == "large" && c > opt.large_max_conc) continue;
    if (c > 1) {
      // One request per worker, all in flight at once, unmeasured: each holds its own pinned
      // buffer, and pinning a new one (cudaHostAlloc, ~0.3 s per GiB) belongs to the server's
      // warm-up, not to the cell.
      CellSpec warm_c{"flashserve", kAttention, &w.serialized, -1, c, 0, c, c, false};
      Cell(server, warm_c).Run();
    }
    CellSpec spec{"flashserve", kAttention, &w.serialized, -1, c, opt.duration, opt.min_requests,
                  1 << 30, true};
    CellResult r = Cell(server, spec).Run();
    r.shape = w.shape.name;
    CellResult e;
    if (echo_pool != nullptr) {
      CellSpec espec{"echo", kEcho, &w.serialized, response_bytes, c, opt.duration,
                     opt.min_requests, 1 << 30, false};
      e = Cell(echo_pool, espec).Run();
      e.shape = w.shape.name;
    }
    WriteCsvRow(out.csv, r);
    if (echo_pool != nullptr) WriteCsvRow(out.csv, e);
    out.csv.flush();
    WriteUnaryRows(out, w, c, r, echo_pool != nullptr ? &e : nullptr, response_parse_us);
  }
  return true;
}

constexpr char kUnaryHeader[] =
    "### Unary AttentionService/Attention vs raw gRPC echo of the same bytes\n\n"
    "Goodput = (request + response bytes) / latency (p50; `agg` = bytes x calls/s over all "
    "workers). Overhead = server total - h2d - compute - d2h (queue and the host staging copy "
    "included); stage = the server's one host copy of the request tensors (receive slices -> pinned "
    "buffers), part of the overhead. Kernel = server-reported compute_us p50. Ratio (p50) = echo "
    "p50 / flashserve p50 (goodput ratio of the same bytes at the median); ratio (agg) = aggregate "
    "throughput ratio.\n\n"
    "| shape | conc | calls/s | p50 ms | p99 ms | goodput GB/s (p50) | agg GB/s | echo p50 ms | "
    "echo agg GB/s | ratio (p50) | ratio (agg) | overhead p50 us | stage p50 us | overhead - stage "
    "p50 us | h2d p50 us | kernel p50 us | d2h p50 us | client CPU cores | errors |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

constexpr char kBreakdownHeader[] =
    "\n### Where the time goes at concurrency 1 (ms, p50)\n\n"
    "Echo = the raw gRPC round trip of the same bytes (the transport's share). Server total "
    "(handler entry -> answer ready) = stage (one host copy of Q/K/V from the receive slices into "
    "pinned buffers) + queue + h2d + kernel + d2h + rest; the server sends O from those buffers "
    "without a copy. Unexplained = latency - server total - echo (transport variation between the "
    "two cells). Not in the loop: what a real client adds to build its message (client serialize, "
    "here done once) and read O (client parse; this load generator skips the tensor bytes).\n\n"
    "| shape | latency | echo | server total | stage | queue | h2d | kernel | d2h | rest | "
    "unexplained | (client serialize) | (client parse) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

// --- the striped streaming path -----------------------------------------------------------------

// One shape over K striped channels: the reps' p50 row, or a failed row.
void StripedRow(const Options& opt, const Workload& w, int k, std::ostringstream& md) {
  std::vector<std::shared_ptr<grpc::Channel>> chans;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int i = 0; i < k; ++i) {
    chans.push_back(MakeChannel(opt.target, 1000 + i));
    stubs.push_back(std::make_unique<grpc::GenericStub>(chans.back()));
  }
  std::vector<StripedSample> samples;
  std::string output, error;
  for (int rep = 0; rep < opt.stripe_reps + 1; ++rep) {  // first one warms the connections
    StripedSample s{};
    if (!RunStriped(w, chans, stubs, opt.token, opt.chunk_bytes, &output, &s, &error)) break;
    if (rep > 0) samples.push_back(s);
  }
  if (!error.empty()) {
    std::fprintf(stderr, "striped %s K=%d failed: %s\n", w.shape.name.c_str(), k, error.c_str());
    md << "| " << w.shape.name << " | " << k << " | failed: " << error << " |\n";
    return;
  }
  auto p50 = [&](auto get) {
    std::vector<double> v;
    for (const auto& s : samples) v.push_back(get(s));
    return Percentile(v, 0.5);
  };
  const double total = p50([](const StripedSample& s) { return s.total_us; });
  const double bytes = double(3 * w.shape.tensor_bytes() + w.shape.tensor_bytes());
  md << Fmt("| %s | %d | %.1f | %.2f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
            w.shape.name.c_str(), k, total / 1e3, bytes / (total * 1e3),
            p50([](const StripedSample& s) { return s.open_us; }) / 1e3,
            p50([](const StripedSample& s) { return s.upload_us; }) / 1e3,
            p50([](const StripedSample& s) { return s.compute_us; }) / 1e3,
            p50([](const StripedSample& s) { return s.download_us; }) / 1e3,
            p50([](const StripedSample& s) { return double(s.timing[4]); }) / 1e3,
            p50([](const StripedSample& s) { return double(s.timing[1]); }) / 1e3,
            p50([](const StripedSample& s) { return double(s.timing[2]); }) / 1e3,
            p50([](const StripedSample& s) { return double(s.timing[3]); }) / 1e3);
  std::fprintf(stderr, "striped %s K=%d: p50 %.1f ms, %.2f GB/s\n", w.shape.name.c_str(), k,
               total / 1e3, bytes / (total * 1e3));
}

// Striped streaming path vs unary at concurrency 1.
void StripedSection(const Options& opt, const std::vector<std::unique_ptr<Workload>>& workloads,
                    std::ostringstream& md) {
  md << "\n### Striped streaming (AttentionStreamService) vs unary, concurrency 1\n\n"
        "K channels (one connection each); request chunks of "
     << Fmt("%.2f", double(opt.chunk_bytes) / (1 << 20))
     << " MiB round-robin over the K Upload streams; O downloaded as K ranges (K=1: O inline in "
        "the Compute response). p50 over the reps.\n\n"
        "| shape | K | p50 ms | goodput GB/s | open ms | upload ms | compute RPC ms | download ms "
        "| server total ms | h2d ms | kernel ms | d2h ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& wp : workloads) {
    const Workload& w = *wp;
    const auto& shapes = opt.striped_shapes;
    if (std::find(shapes.begin(), shapes.end(), w.shape.name) == shapes.end()) continue;
    for (int k : opt.stripes) StripedRow(opt, w, k, md);
  }
}

// A section's options with the grid settings it shares with the unary grid.
template <typename SectionOptions>
SectionOptions SharedGrid(const Options& opt) {
  SectionOptions section;
  section.concurrency = opt.concurrency;
  section.duration_s = opt.duration;
  section.min_requests = opt.min_requests;
  section.large_max_concurrency = opt.large_max_conc;
  section.device = opt.shm_device;
  return section;
}

// The shared-memory (KServe gRPC) and local-socket sections, each when asked for.
void ShmAndLocalSections(Pool* server, const Options& opt,
                         const std::vector<std::unique_ptr<Workload>>& workloads,
                         std::ofstream& csv, std::ostringstream& md) {
  if (!opt.shm_paths.empty()) {
    auto shm = SharedGrid<flashserve::loadgen::ShmSectionOptions>(opt);
    shm.paths = opt.shm_paths;
    md << flashserve::loadgen::RunShmSection(server, workloads, shm, csv);
  }
  if (!opt.local_socket.empty()) {
    auto local = SharedGrid<flashserve::loadgen::LocalSectionOptions>(opt);
    local.socket_path = opt.local_socket;
    local.token = opt.token;
    local.shm_paths = opt.local_shm;
    local.max_frame_bytes = opt.local_max_frame_bytes;
    local.client_spin_us = opt.client_spin_us;
    md << flashserve::loadgen::RunLocalSection(server, workloads, local, csv);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseOptions(argc, argv);
  std::fprintf(stderr, "loadgen: %d channels to %s%s%s%s\n", opt.pool_size, opt.target.c_str(),
               opt.echo.empty() ? "" : " and to echo ", opt.echo.c_str(),
               opt.token.empty() ? "" : " (with a bearer token)");
  Pool server(opt.target, opt.pool_size, opt.token);
  std::unique_ptr<Pool> echo_pool;
  if (!opt.echo.empty()) echo_pool = std::make_unique<Pool>(opt.echo, opt.pool_size, opt.token);
  std::ofstream csv(opt.csv_path);
  csv << kCsvHeader;
  std::ostringstream md, breakdown;
  if (echo_pool) EchoCeilingSection(echo_pool.get(), opt, md);
  md << kUnaryHeader;
  std::vector<std::unique_ptr<Workload>> workloads;
  for (const std::string& name : opt.shapes) {
    const Shape* shape = nullptr;
    for (const Shape& s : kShapes) {
      if (s.name == name) shape = &s;
    }
    workloads.push_back(MakeWorkload(*shape));
    const Workload& w = *workloads.back();
    std::fprintf(stderr, "shape %s: request %zu bytes (serialize %.0f us, parse %.0f us)\n",
                 name.c_str(), w.serialized.size(), w.serialize_us, w.parse_us);
    if (!UnaryShape(&server, echo_pool.get(), opt, w, {csv, md, breakdown})) return 1;
  }
  md << kBreakdownHeader << breakdown.str();
  if (!opt.stripes.empty() && opt.stripe_reps > 0) StripedSection(opt, workloads, md);
  ShmAndLocalSections(&server, opt, workloads, csv, md);
  const std::string md_text = md.str();
  std::ofstream(opt.md_path) << md_text;
  std::printf("%s", md_text.c_str());
  return 0;
}
