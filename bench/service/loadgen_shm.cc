#include "loadgen_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <ostream>

#include "inference/open_inference_grpc.grpc.pb.h"
#ifdef FLASHSERVE_LOADGEN_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashserve::loadgen {
namespace {

// A region of the load generator's own, registered with the server under `name`.
struct Region {
  std::string name;
  char* host = nullptr;  // system: the mapping (also where inputs are written)
  void* device = nullptr;
  size_t bytes = 0;
  std::function<void()> release;
  ~Region() {
    if (release) release();
  }
};

std::unique_ptr<Region> SystemRegion(const std::string& name, size_t bytes,
                                     inference::GRPCInferenceService::Stub* stub, std::string* error) {
  auto r = std::make_unique<Region>();
  r->name = name;
  r->bytes = bytes;
  const std::string key = "/" + name + "_" + std::to_string(getpid());
  const int fd = shm_open(key.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0 || ftruncate(fd, off_t(bytes)) != 0) {
    *error = "shm_open/ftruncate " + key + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *error = "mmap " + key;
    shm_unlink(key.c_str());
    return nullptr;
  }
  r->host = static_cast<char*>(p);
  r->release = [p, bytes, key] {
    munmap(p, bytes);
    shm_unlink(key.c_str());
  };
  inference::SystemSharedMemoryRegisterRequest req;
  req.set_name(name);
  req.set_key(key);
  req.set_byte_size(bytes);
  inference::SystemSharedMemoryRegisterResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status s = stub->SystemSharedMemoryRegister(&ctx, req, &resp);
  if (!s.ok()) {
    *error = "SystemSharedMemoryRegister " + name + ": " + s.error_message();
    return nullptr;
  }
  return r;
}

#ifdef FLASHSERVE_LOADGEN_CUDA
std::unique_ptr<Region> CudaRegion(const std::string& name, size_t bytes, int device,
                                   inference::GRPCInferenceService::Stub* stub, std::string* error) {
  auto r = std::make_unique<Region>();
  r->name = name;
  r->bytes = bytes;
  cudaSetDevice(device);
  cudaIpcMemHandle_t handle;
  if (cudaMalloc(&r->device, bytes) != cudaSuccess ||
      cudaIpcGetMemHandle(&handle, r->device) != cudaSuccess) {
    *error = std::string("cudaMalloc/cudaIpcGetMemHandle: ") + cudaGetErrorString(cudaGetLastError());
    return nullptr;
  }
  r->release = [p = r->device] { cudaFree(p); };
  inference::CudaSharedMemoryRegisterRequest req;
  req.set_name(name);
  req.set_raw_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  req.set_device_id(device);
  req.set_byte_size(bytes);
  inference::CudaSharedMemoryRegisterResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status s = stub->CudaSharedMemoryRegister(&ctx, req, &resp);
  if (!s.ok()) {
    *error = "CudaSharedMemoryRegister " + name + ": " + s.error_message();
    return nullptr;
  }
  return r;
}
#endif

void Unregister(inference::GRPCInferenceService::Stub* stub, const std::string& path,
                const std::string& name) {
  grpc::ClientContext ctx;
  if (path == "cuda") {
    inference::CudaSharedMemoryUnregisterRequest req;
    req.set_name(name);
    inference::CudaSharedMemoryUnregisterResponse resp;
    stub->CudaSharedMemoryUnregister(&ctx, req, &resp);
  } else {
    inference::SystemSharedMemoryUnregisterRequest req;
    req.set_name(name);
    inference::SystemSharedMemoryUnregisterResponse resp;
    stub->SystemSharedMemoryUnregister(&ctx, req, &resp);
  }
}

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

// Puts the workload's Q, K, V into region `in`.
bool Fill(const Workload& w, Region* in, std::string* error) {
  const std::string* data[3] = {&w.request.q().data(), &w.request.k().data(), &w.request.v().data()};
  size_t at = 0;
  for (const std::string* d : data) {
    if (in->host != nullptr) {
      std::memcpy(in->host + at, d->data(), d->size());
    }
#ifdef FLASHSERVE_LOADGEN_CUDA
    else if (cudaMemcpy(static_cast<char*>(in->device) + at, d->data(), d->size(),
                        cudaMemcpyHostToDevice) != cudaSuccess) {
      *error = "cudaMemcpy into the CUDA region";
      return false;
    }
#endif
    at += d->size();
  }
  return true;
}

std::unique_ptr<Region> MakeRegion(const std::string& path, const std::string& name, size_t bytes,
                                   int device, inference::GRPCInferenceService::Stub* stub,
                                   std::string* error) {
  if (path == "system") return SystemRegion(name, bytes, stub, error);
#ifdef FLASHSERVE_LOADGEN_CUDA
  if (path == "cuda") return CudaRegion(name, bytes, device, stub, error);
#endif
  (void)device;
  *error = "path " + path + " is not available in this build (cuda needs a CUDA build)";
  return nullptr;
}

// One cell: its CSV row (the columns of loadgen.cc's; goodput and stage left empty) and table row.
std::string Report(const CellResult& r, const std::string& path, std::ostream& csv) {
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

}  // namespace

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
      "Server timing from the response's parameters (stage is not reported there: 0).\n\n"
      "| shape | path | conc | calls/s | p50 us | p99 us | server total p50 us | h2d p50 us | kernel p50 us | "
      "d2h p50 us | overhead p50 us | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& wp : workloads) {
    const Workload& w = *wp;
    const size_t in_bytes = w.request.q().data().size() + w.request.k().data().size() +
                            w.request.v().data().size();
    for (const std::string& path : options.paths) {
      std::string error;
      const std::string in_name = "lg_in_" + w.shape.name + "_" + path;
      const std::string out_name = "lg_out_" + w.shape.name + "_" + path;
      auto in = MakeRegion(path, in_name, in_bytes, options.device, stub.get(), &error);
      auto out = in ? MakeRegion(path, out_name, w.request.q().data().size(), options.device,
                                 stub.get(), &error)
                    : nullptr;
      if (!in || !out || !Fill(w, in.get(), &error)) {
        std::fprintf(stderr, "shm %s %s: %s\n", path.c_str(), w.shape.name.c_str(), error.c_str());
        md += "| " + w.shape.name + " | " + path + " | failed: " + error + " |\n";
        if (in) Unregister(stub.get(), path, in_name);
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
        md += Report(r, path, csv);
        std::fprintf(stderr, "shm %s %s c=%d: %lld ok %lld err, p50 %.0f us %s\n", path.c_str(),
                     w.shape.name.c_str(), c, (long long)r.ok, (long long)r.errors,
                     Percentile(r.latency_us, 0.5), r.first_error.c_str());
      }
      Unregister(stub.get(), path, in_name);
      Unregister(stub.get(), path, out_name);
    }
  }
  return md;
}

}  // namespace flashserve::loadgen
