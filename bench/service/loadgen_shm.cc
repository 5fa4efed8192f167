#include "loadgen_shm.h"

#include <cstdio>
#include <ostream>

#include "inference/open_inference_grpc.grpc.pb.h"
#include "loadgen_regions.h"
#include "loadgen_targets.h"

namespace flashserve::loadgen {
namespace {

void NameRegion(google::protobuf::Map<std::string, inference::InferParameter>* params,
                const std::string& region, int64_t offset, int64_t bytes) {
  (*params)["shared_memory_region"].set_string_param(region);
  (*params)["shared_memory_offset"].set_int64_param(offset);
  (*params)["shared_memory_byte_size"].set_int64_param(bytes);
}

// The ModelInfer request naming Q, K, V in `in` (back to back) and O in `out`.
std::string ShmRequest(const Workload& w, const std::string& in, const std::string& out) {
  inference::ModelInferRequest req;
  req.set_model_name("attention");
  req.set_id(w.request.request_id());
  (*req.mutable_parameters())["causal"].set_bool_param(w.request.causal());
  const v1::Tensor* tensors[3] = {&w.request.q(), &w.request.k(), &w.request.v()};
  const char* names[3] = {"Q", "K", "V"};
  int64_t at = 0;
  for (int i = 0; i < 3; ++i) {
    auto* input = req.add_inputs();
    input->set_name(names[i]);
    input->set_datatype("BF16");
    for (int64_t d : tensors[i]->shape()) input->add_shape(d);
    NameRegion(input->mutable_parameters(), in, at, int64_t(tensors[i]->data().size()));
    at += int64_t(tensors[i]->data().size());
  }
  auto* o = req.add_outputs();
  o->set_name("O");
  NameRegion(o->mutable_parameters(), out, 0, int64_t(w.request.q().data().size()));
  return req.SerializeAsString();
}

}  // namespace

// One cell: its CSV row (the columns of loadgen.cc's; goodput and stage left empty) and table row.
std::string ShmRow(const CellResult& r, const std::string& path, std::ostream& csv) {
  csv << r.target << ',' << r.shape << ',' << r.concurrency << ',' << r.channels << ',' << r.ok
      << ',' << r.errors << ',' << r.wall_s << ',' << double(r.ok) / r.wall_s << ','
      << Percentile(r.latency_us, 0.5) << ',' << Percentile(r.latency_us, 0.99) << ','
      << r.request_bytes << ',' << r.response_bytes << ",,," << Percentile(Column(r, 0), 0.5)
      << ',' << Percentile(Column(r, 1), 0.5) << ',' << Percentile(Column(r, 2), 0.5) << ','
      << Percentile(Column(r, 3), 0.5) << ',' << Percentile(Column(r, 4), 0.5) << ','
      << Percentile(Overhead(r), 0.5) << ',' << Percentile(Overhead(r), 0.99) << ','
      << r.cpu_s / r.wall_s << ",\"" << r.first_error << "\",,\n";
  char line[512];
  std::snprintf(line, sizeof line,
                "| %s | %s | %d | %.1f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %lld |\n",
                r.shape.c_str(), path.c_str(), r.concurrency, double(r.ok) / r.wall_s,
                Percentile(r.latency_us, 0.5), Percentile(r.latency_us, 0.99),
                Percentile(Column(r, 4), 0.5), Percentile(Column(r, 1), 0.5),
                Percentile(Column(r, 2), 0.5), Percentile(Column(r, 3), 0.5),
                Percentile(Overhead(r), 0.5), (long long)r.errors);
  return line;
}

std::string ShmTableHeader() {
  return "| shape | path | conc | calls/s | p50 us | p99 us | server total p50 us | h2d p50 us | "
         "kernel p50 us | d2h p50 us | overhead p50 us | errors |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
}

bool FillQkv(const Workload& w, Region* in, std::string* error) {
  const std::string* data[3] = {&w.request.q().data(), &w.request.k().data(), &w.request.v().data()};
  size_t at = 0;
  for (const std::string* d : data) {
    if (!WriteRegion(in, at, d->data(), d->size(), error)) return false;
    at += d->size();
  }
  return true;
}

bool ParseKServeTiming(grpc::ByteBuffer* buffer, int64_t timing[6]) {
  std::vector<grpc::Slice> slices;
  if (!buffer->Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  inference::ModelInferResponse resp;
  if (!resp.ParseFromString(bytes)) return false;
  const char* keys[6] = {"queue_us", "h2d_us", "compute_us", "d2h_us", "total_us", "stage_us"};
  for (int i = 0; i < 6; ++i) {
    auto it = resp.parameters().find(keys[i]);
    timing[i] = it == resp.parameters().end() ? 0 : it->second.int64_param();
  }
  return true;
}

std::string RunShmSection(Pool* server, const std::vector<std::unique_ptr<Workload>>& workloads,
                          const ShmSectionOptions& options, std::ostream& csv) {
  auto stub = inference::GRPCInferenceService::NewStub(server->channels.front());
  std::string md =
      "\n### Shared memory (KServe ModelInfer naming regions; server started with --allow_client_shm)\n\n"
      "Q, K, V in one region of the load generator, O written into another; no tensor byte on the socket. "
      "Server timing from the response's parameters (stage is not reported there: 0).\n\n" +
      ShmTableHeader();
  C1Rows c1;
  for (const auto& wp : workloads) {
    const Workload& w = *wp;
    const size_t in_bytes = w.request.q().data().size() + w.request.k().data().size() +
                            w.request.v().data().size();
    for (const std::string& path : options.paths) {
      std::string error;
      const std::string in_name = "lg_in_" + w.shape.name + "_" + path;
      const std::string out_name = "lg_out_" + w.shape.name + "_" + path;
      auto in = MakeRegion(path, in_name, in_bytes, options.device, stub.get(), server->token, &error);
      auto out = in ? MakeRegion(path, out_name, w.request.q().data().size(), options.device,
                                 stub.get(), server->token, &error)
                    : nullptr;
      if (!in || !out || !FillQkv(w, in.get(), &error) || !Poison(out.get(), 0, out->bytes, &error)) {
        std::fprintf(stderr, "shm %s %s: %s\n", path.c_str(), w.shape.name.c_str(), error.c_str());
        md += "| " + w.shape.name + " | " + path + " | failed: " + error + " |\n";
        continue;
      }
      const std::string request = ShmRequest(w, in_name, out_name);
      const std::string method = "/inference.GRPCInferenceService/ModelInfer";
      for (int c : options.concurrency) {
        if (w.shape.name == "large" && c > options.large_max_concurrency) continue;
        CellSpec warm{"shm_" + path, method, &request, -1, c, 0, 2 * c, 2 * c, false};
        Cell(server, warm).Run();
        CellSpec spec{"shm_" + path, method, &request, -1, c, options.duration_s,
                      options.min_requests, 1 << 30, true};
        spec.kserve_timing = true;
        CellResult r = Cell(server, spec).Run();
        r.shape = w.shape.name;
        md += ShmRow(r, path, csv);
        if (c == 1 && r.ok > 0) {
          c1[w.shape.name + "/" + path] = C1Of(r);
        }
        std::fprintf(stderr, "shm %s %s c=%d: %lld ok %lld err, p50 %.0f us %s\n", path.c_str(),
                     w.shape.name.c_str(), c, (long long)r.ok, (long long)r.errors,
                     Percentile(r.latency_us, 0.5), r.first_error.c_str());
      }
      if (!CheckWritten(*out, 0, out->bytes, &error)) {  // O really went into the region
        std::fprintf(stderr, "shm %s %s: %s\n", path.c_str(), w.shape.name.c_str(), error.c_str());
        md += "| " + w.shape.name + " | " + path + " | O check failed: " + error + " |\n";
      }
    }
  }
  return md + TargetsTable("Against issue 18's targets over gRPC (c=1, p50)", c1, "");
}

}  // namespace flashserve::loadgen
