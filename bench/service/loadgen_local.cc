#include "loadgen_local.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <map>

#include "inference/open_inference_grpc.grpc.pb.h"
#include "loadgen_local_cell.h"
#include "loadgen_format.h"
#include "loadgen_regions.h"
#include "loadgen_shm.h"
#include "loadgen_targets.h"

namespace flashserve::loadgen {
namespace {

using local::Method;

LocalCellSpec MakeSpec(const LocalSectionOptions& options, const std::string& name, Method method,
                       const std::string* payload, int c, bool timing) {
  LocalCellSpec spec;
  spec.target_name = name;
  spec.client.socket_path = options.socket_path;
  spec.client.token = options.token;
  spec.client.timeout_ms = options.timeout_ms;
  spec.client.spin_us = options.client_spin_us;
  spec.method = method;
  spec.payload = payload;
  spec.concurrency = c;
  spec.duration_s = options.duration_s;
  spec.min_requests = options.min_requests;
  spec.read_timing = timing;
  if (method == Method::kEcho) spec.expect_reply_bytes = int64_t(payload->size());
  return spec;
}

struct Section {
  const LocalSectionOptions& options;
  std::ostream& csv;
  std::string md;
  C1Rows c1;

  // One path of one shape over every concurrency: a warm-up per c, then the measured cell.
  void RunPath(const Workload& w, const std::string& path, Method method,
               const std::string& payload) {
    const bool timing = method != Method::kEcho;
    for (int c : options.concurrency) {
      if (w.shape.name == "large" && c > options.large_max_concurrency) continue;
      LocalCellSpec warm = MakeSpec(options, "local_warm", method, &payload, c, false);
      warm.duration_s = 0;
      warm.min_requests = 2 * c;
      RunLocalCell(warm);
      CellResult r = RunLocalCell(MakeSpec(options, "local_" + path, method, &payload, c, timing));
      r.shape = w.shape.name;
      md += ShmRow(r, "local " + path, csv);
      std::fprintf(stderr, "local %s %s c=%d: %lld ok %lld err, p50 %.0f us %s\n", path.c_str(),
                   w.shape.name.c_str(), c, (long long)r.ok, (long long)r.errors,
                   Percentile(r.latency_us, 0.5), r.first_error.c_str());
      if (c == 1 && r.ok > 0) {
        c1[w.shape.name + "/" + path] = C1Of(r);
      }
    }
  }
};

// AttentionRequest naming Q, K, V in region `in` (back to back) and O in region `out`.
std::string NativeShmRequest(const Workload& w, const std::string& in, const std::string& out) {
  v1::AttentionRequest req;
  req.set_request_id(w.request.request_id());
  req.set_causal(w.request.causal());
  const v1::Tensor* from[3] = {&w.request.q(), &w.request.k(), &w.request.v()};
  v1::Tensor* to[3] = {req.mutable_q(), req.mutable_k(), req.mutable_v()};
  uint64_t at = 0;
  for (int i = 0; i < 3; ++i) {
    to[i]->set_dtype(from[i]->dtype());
    *to[i]->mutable_shape() = from[i]->shape();
    to[i]->mutable_shm()->set_region(in);
    to[i]->mutable_shm()->set_offset(at);
    to[i]->mutable_shm()->set_byte_size(from[i]->data().size());
    at += from[i]->data().size();
  }
  req.mutable_out_shm()->set_region(out);
  req.mutable_out_shm()->set_byte_size(w.request.q().data().size());
  return req.SerializeAsString();
}

void RunShmPath(Section* s, inference::GRPCInferenceService::Stub* stub, const Workload& w,
                const std::string& path, bool with_echo) {
  const size_t in_bytes =
      w.request.q().data().size() + w.request.k().data().size() + w.request.v().data().size();
  const std::string suffix = w.shape.name + "_" + path + "_" + std::to_string(getpid());
  const std::string in_name = "lgl_in_" + suffix, out_name = "lgl_out_" + suffix;
  std::string error;
  auto in = MakeRegion(path, in_name, in_bytes, s->options.device, stub, s->options.token, &error);
  auto out = in ? MakeRegion(path, out_name, w.request.q().data().size(), s->options.device, stub,
                             s->options.token, &error)
                : nullptr;
  if (!in || !out || !FillQkv(w, in.get(), &error) || !Poison(out.get(), 0, out->bytes, &error)) {
    std::fprintf(stderr, "local %s %s: %s\n", path.c_str(), w.shape.name.c_str(), error.c_str());
    s->md += "| " + w.shape.name + " | local " + path + " | failed: " + error + " |\n";
    return;
  }
  const std::string request = NativeShmRequest(w, in_name, out_name);
  if (with_echo) s->RunPath(w, "echo (shm request bytes)", Method::kEcho, request);
  s->RunPath(w, path, Method::kAttention, request);
  if (!CheckWritten(*out, 0, out->bytes, &error)) {  // O really went into the region
    std::fprintf(stderr, "local %s %s: %s\n", path.c_str(), w.shape.name.c_str(), error.c_str());
    s->md += "| " + w.shape.name + " | local " + path + " | O check failed: " + error + " |\n";
  }
}

void RunShape(Section* s, inference::GRPCInferenceService::Stub* stub, const Workload& w) {
  if (w.serialized.size() <= s->options.max_frame_bytes) {
    s->RunPath(w, "echo (inline request bytes)", Method::kEcho, w.serialized);
    s->RunPath(w, "inline", Method::kAttention, w.serialized);
  } else {
    s->md += "| " + w.shape.name + " | local inline | skipped: request of " +
             std::to_string(w.serialized.size()) + " bytes > --local_max_frame_bytes |\n";
  }
  for (size_t i = 0; i < s->options.shm_paths.size(); ++i) {
    RunShmPath(s, stub, w, s->options.shm_paths[i], i == 0);
  }
}

std::string FloorTable(const LocalSectionOptions& options) {
  std::string md =
      "Floor: tiny Echo frames (64 B each way), one connection per worker.\n\n"
      "| concurrency | calls/s | p50 us | p99 us | client CPU cores | errors |\n|---|---|---|---|---|---|\n";
  const std::string tiny(64, 'x');
  for (int c : options.concurrency) {
    CellResult r = RunLocalCell(MakeSpec(options, "local_echo_tiny", Method::kEcho, &tiny, c, false));
    md += Fmt("| %d | %.0f | %.1f | %.1f | %.2f | %lld |\n", c, double(r.ok) / r.wall_s,
              Percentile(r.latency_us, 0.5), Percentile(r.latency_us, 0.99), r.cpu_s / r.wall_s,
              (long long)r.errors);
    if (r.ok == 0) md += "\nfirst error: " + r.first_error + "\n\n";
  }
  return md + "\n";
}

}  // namespace

std::string RunLocalSection(Pool* server, const std::vector<std::unique_ptr<Workload>>& workloads,
                            const LocalSectionOptions& options, std::ostream& csv) {
  auto stub = inference::GRPCInferenceService::NewStub(server->channels.front());
  Section s{options, csv, "", {}};
  s.md = "\n### Local transport (--local_socket=" + options.socket_path +
         ": length-prefixed protobuf frames over a Unix socket, no gRPC)\n\n" + FloorTable(options) +
         "Per shape: `echo (... bytes)` = Echo frames of exactly that cell's request bytes (the "
         "transport's floor for it, server columns 0); `inline` = AttentionRequest with the tensor "
         "bytes in the frame; `system` / `cuda` = AttentionRequest naming regions (Tensor.shm, "
         "out_shm), registered over KServe gRPC. Server timing from the response.\n\n" +
         ShmTableHeader();
  for (const auto& w : workloads) RunShape(&s, stub.get(), *w);
  s.md += TargetsTable("Against issue 18's targets over the local transport (c=1, p50)", s.c1,
                       "echo (shm request bytes)");
  return s.md;
}

}  // namespace flashserve::loadgen
