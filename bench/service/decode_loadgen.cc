// flashserve-decode-loadgen: decode-step latency of the Sequences API (issue 20) from a C++ client,
// so that what is measured is the server and the transport, not a Python client's serialization.
//
// One Llama-3-8B-like layer (32 q heads, 8 kv heads, d128, bf16). `--sequences` sequences are
// created with a `--context`-token prefix; then for each concurrency c, c client threads (one
// connection each) each send DecodeStep for their share of the sequences (one new token's q, k, v
// per sequence; the same request re-sent: over gRPC the stub serializes it on every call, the
// local transport sends bytes serialized once), closed loop. `--mode=full_kv` sends the
// same step through AttentionService.Attention with each sequence's whole K/V instead (split into
// calls under gRPC's 2 GiB limit). One JSON line per row on stdout (decode_bench.py --cpp_loadgen).
// Sequences mode, where DecodeStep goes (decode_transport.h): --local_socket=PATH sends it over the
// local transport (the server's --local_socket) instead of gRPC; --shm=system|cuda puts every
// item's q/k/v in a region of the load generator's and has O written into one (the server needs
// --allow_client_shm; cuda needs a CUDA build of this tool, regions on --shm_device). Sequences
// are created and released over gRPC (--target) either way. A row whose calls fail is printed as
// {"path", "context", "concurrency", "error"} and the exit status is 3.
// --echo=HOST:PORT (mode sequences): after each concurrency level, the same clients' serialized
// DecodeStep bytes go to flashserve-echo (echo_server.cc), which answers with as many bytes as the
// DecodeStepResponse that client got, with the same concurrency, warm-up and steps: the raw gRPC
// round trip of the same bytes, in the row as echo_p50_ms / echo_p99_ms (echo_error if it failed;
// the row itself still counts), and client_serialize_us / client_parse_us: what client 0's
// request serialization and response parsing cost on their own (median of 5; the sync stub pays
// both on every call, the echo neither).
// Every row also says where its slowest calls' time went: slow_<total|compute|prepare|queue|stage|
// h2d|kernel|d2h>_us, the medians of the server's timings over the calls at or above the row's p99,
// and client_wall_s_min / _max, the fastest and slowest client's time for its steps (unequal
// when the server serves the clients unevenly), and attended_p50: the median number of keys a
// step attended (every step appends a token and levels run one after another on the same
// sequences, so this is above --context: compare with the kernel alone at this length).
// --split=1,8: each client's step is also sent as N DecodeStep calls at once, each on a connection
// of its own, and measured until the last answers (decode_split.h; rows "..., split N").
// The flags: kUsage below (--help prints it); an unknown or malformed flag is an error (exit 2).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench_flags.h"
#include "decode_rows.h"
#include "decode_split.h"
#include "decode_transport.h"
#include "flashserve/v1/attention.grpc.pb.h"
#include "flashserve/v1/sequences.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "loadgen_workload.h"

namespace {

namespace v1 = flashserve::v1;
using flashserve::loadgen::Clock;
using flashserve::loadgen::DecodeClient;
using flashserve::loadgen::DecodeRegions;
using flashserve::loadgen::DecodeTransportOptions;
using flashserve::loadgen::EchoClient;
using flashserve::loadgen::JsonEscape;
using flashserve::loadgen::MakeChannel;
using flashserve::loadgen::Micros;
using flashserve::loadgen::Percentile;
using flashserve::loadgen::RowShape;
using flashserve::loadgen::RunClients;
using flashserve::loadgen::Sample;
using flashserve::loadgen::SplitDecodeClient;
using flashserve::loadgen::SplitEchoClient;

constexpr int64_t kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
constexpr int64_t kMaxMessage = (int64_t(1) << 31) - 1;

struct Options {
  std::string target = "127.0.0.1:8001", token, mode = "sequences";
  std::string echo;  // non-empty: flashserve-echo's host:port (the raw gRPC floor per row)
  int64_t context = 1024, sequences = 64;
  std::vector<int> concurrency{1, 8};
  std::vector<int> split{1};  // each client's step as this many calls at once (decode_split.h)
  int steps = 200, warmup = 20;
  DecodeTransportOptions transport;  // how DecodeStep goes (gRPC or local; inline or shm)
  bool answer_packed = false;        // --packed=2: packed.answer_packed (O as one tensor)
};

// Normal random bf16 values: a block of 64 Ki drawn fresh, repeated (gigabytes of K/V would take a
// minute to draw one by one; the values do not change the timing).
std::string RandomBf16(int64_t count, std::mt19937* rng) {
  constexpr int64_t kBlock = 1 << 16;
  std::normal_distribution<float> normal;
  std::string block(size_t(std::min(count, kBlock)) * 2, '\0');
  for (size_t i = 0; i < block.size() / 2; ++i) {
    const float f = normal(*rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint16_t bf =
        uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
    std::memcpy(&block[i * 2], &bf, 2);
  }
  std::string bytes;
  bytes.reserve(size_t(count) * 2);
  while (int64_t(bytes.size()) < count * 2) {
    bytes.append(block, 0, std::min(block.size(), size_t(count * 2) - bytes.size()));
  }
  return bytes;
}

v1::Tensor Bf16Tensor(std::vector<int64_t> shape, std::mt19937* rng) {
  v1::Tensor t;
  t.set_dtype(v1::BFLOAT16);
  int64_t count = 1;
  for (int64_t s : shape) {
    t.add_shape(s);
    count *= s;
  }
  t.set_data(RandomBf16(count, rng));
  return t;
}

RowShape Shape(const Options& opt) { return {opt.context, opt.sequences, opt.steps}; }

void Authorize(grpc::ClientContext* ctx, const Options& opt) {
  flashserve::loadgen::Authorize(ctx, opt.token);
}

[[noreturn]] void Die(const std::string& what, const grpc::Status& s) {
  std::fprintf(stderr, "decode-loadgen: %s failed: %d %s\n", what.c_str(), int(s.error_code()),
               s.error_message().c_str());
  std::exit(1);
}

// --- sequences ----------------------------------------------------------------------------------

std::vector<std::string> CreateSequences(v1::Sequences::Stub* stub, const Options& opt,
                                         std::mt19937* rng) {
  v1::CreateSequenceRequest request;
  request.set_num_layers(1);
  request.set_heads_q(int32_t(kHeadsQ));
  request.set_heads_kv(int32_t(kHeadsKv));
  request.set_head_dim(int32_t(kHeadDim));
  request.set_dtype(v1::BFLOAT16);
  v1::LayerKV* prefix =
      request.add_prefix();  // the same rows for every sequence: contents do not matter
  prefix->set_layer(0);
  *prefix->mutable_k() = Bf16Tensor({opt.context, kHeadsKv, kHeadDim}, rng);
  *prefix->mutable_v() = Bf16Tensor({opt.context, kHeadsKv, kHeadDim}, rng);
  std::vector<std::string> ids;
  for (int64_t i = 0; i < opt.sequences; ++i) {
    grpc::ClientContext ctx;
    Authorize(&ctx, opt);
    v1::CreateSequenceResponse response;
    grpc::Status s = stub->CreateSequence(&ctx, request, &response);
    if (!s.ok()) Die("CreateSequence", s);
    ids.push_back(response.sequence_id());
  }
  return ids;
}

void Release(v1::Sequences::Stub* stub, const Options& opt, const std::vector<std::string>& ids) {
  grpc::ClientContext ctx;
  Authorize(&ctx, opt);
  v1::ReleaseRequest request;
  for (const std::string& id : ids) request.add_sequence_ids(id);
  v1::ReleaseResponse response;
  grpc::Status s = stub->Release(&ctx, request, &response);
  if (!s.ok()) Die("Release", s);
}

// Client i's DecodeStep: its share (a contiguous slice) of the sequences, one new token each; with
// `regions`, q/k/v are references to each sequence's place there and O is written there.
std::vector<v1::DecodeStepRequest> DecodeRequests(const std::vector<std::string>& ids, int clients,
                                                  const v1::Tensor& q, const v1::Tensor& kv,
                                                  const DecodeRegions* regions) {
  std::vector<v1::DecodeStepRequest> requests(static_cast<size_t>(clients));
  for (size_t i = 0; i < ids.size(); ++i) {
    v1::DecodeItem* item = requests[i * size_t(clients) / ids.size()].add_items();
    item->set_sequence_id(ids[i]);
    item->set_layer(0);
    *item->mutable_q() = q;
    *item->mutable_k() = kv;
    *item->mutable_v() = kv;
    if (regions != nullptr) regions->Name(int64_t(i), item);
  }
  return requests;
}

// --- the two paths
// --------------------------------------------------------------------------------

// The row's name: "sequences" plus the transport and where the tensors live, when not the default.
std::string SequencesPath(const Options& opt) {
  std::string path = "sequences";
  if (!opt.transport.local_socket.empty()) path += ", local";
  if (opt.transport.shm != "none") path += ", shm " + opt.transport.shm;
  if (opt.transport.packed) path += opt.answer_packed ? ", packed, answer packed" : ", packed";
  if (!opt.transport.local_socket.empty() && opt.transport.spin_us > 0) {
    path += ", client spin " + std::to_string(opt.transport.spin_us) + " us";
  }
  return path;
}

void RecordTiming(const v1::DecodeStepResponse& response, Sample* sample) {
  sample->total_us = response.timing().total_us();
  sample->compute_us = response.timing().compute_us();
  sample->merged = response.batched_calls();
  sample->prepare_us = response.timing().prepare_us();
  sample->queue_us = response.timing().queue_us();
  sample->stage_us = response.timing().stage_us();
  sample->h2d_us = response.timing().h2d_us();
  sample->kernel_us = response.timing().kernel_us();
  sample->d2h_us = response.timing().d2h_us();
  sample->length = response.results_size() > 0 ? response.results(0).length() : 0;
}

// The client's own proto work per call, apart from gRPC: serializing `request` and parsing
// `response_bytes` into a fresh message, as the sync stub does (median of 5 each).
std::string ProtoCostFields(const v1::DecodeStepRequest& request,
                            const std::string& response_bytes) {
  std::vector<double> serialize_us, parse_us;
  for (int i = 0; i < 5; ++i) {
    Clock::time_point t0 = Clock::now();
    const std::string bytes = request.SerializeAsString();  // a fresh buffer, as on each call
    serialize_us.push_back(Micros(Clock::now() - t0));
    v1::DecodeStepResponse response;
    t0 = Clock::now();
    if (!response.ParseFromString(response_bytes)) return ", \"client_parse_error\": true";
    parse_us.push_back(Micros(Clock::now() - t0));
  }
  char buffer[128];
  std::snprintf(buffer, sizeof(buffer),
                ", \"client_serialize_us\": %.1f, \"client_parse_us\": %.1f",
                Percentile(serialize_us, 50), Percentile(parse_us, 50));
  return buffer;
}

// The raw gRPC echo of one level's requests (call i = c * split + j: requests[i]'s bytes, answered
// with as many bytes as responses[i], the answer it got), same clients, split, warm-up and steps;
// the row's JSON fields for it. Unsplit clients echo through the blocking path, as they step.
std::string EchoFields(const Options& opt, int clients, int split,
                       const std::vector<v1::DecodeStepRequest>& requests,
                       const std::vector<std::string>& responses) {
  std::vector<std::unique_ptr<EchoClient>> conns;
  std::vector<std::unique_ptr<SplitEchoClient>> split_conns;
  int64_t request_max = 0, response_max = 0;
  for (int c = 0; c < clients; ++c) {
    std::vector<std::string> bytes;
    std::vector<int64_t> response_bytes;
    for (int j = 0; j < split; ++j) {
      const size_t i = size_t(c) * size_t(split) + size_t(j);
      bytes.push_back(requests[i].SerializeAsString());
      response_bytes.push_back(int64_t(responses[i].size()));
      request_max = std::max(request_max, int64_t(bytes.back().size()));
      response_max = std::max(response_max, response_bytes.back());
    }
    if (split == 1) {
      conns.push_back(std::make_unique<EchoClient>(opt.echo, c, opt.token, std::move(bytes[0]),
                                                   response_bytes[0]));
    } else {
      split_conns.push_back(std::make_unique<SplitEchoClient>(
          opt.echo, opt.token, c, std::move(bytes), std::move(response_bytes)));
    }
  }
  auto call = [&](int c, Sample*, std::string* failed) {
    return split == 1 ? conns[size_t(c)]->Step(failed) : split_conns[size_t(c)]->Step(failed);
  };
  double wall_s = 0;
  std::string error;
  const std::vector<Sample> samples =
      RunClients(clients, opt.steps, opt.warmup, call, &wall_s, &error);
  if (!error.empty()) {
    std::fprintf(stderr, "decode-loadgen: echo, %d clients: %s\n", clients, error.c_str());
    return ", \"echo_error\": \"" + JsonEscape(error) + "\"";
  }
  std::vector<double> latency;
  for (const Sample& s : samples) latency.push_back(s.latency_us / 1e3);
  char buffer[256];
  std::snprintf(buffer, sizeof(buffer),
                ", \"echo_p50_ms\": %.4f, \"echo_p99_ms\": %.4f, \"echo_n\": %zu, "
                "\"echo_request_bytes\": %lld, \"echo_response_bytes\": %lld",
                Percentile(latency, 50), Percentile(latency, 99), samples.size(),
                (long long)request_max, (long long)response_max);
  return buffer + ProtoCostFields(requests[0], responses[0]);
}

// One concurrency level of the Sequences path; false when it failed (an error row was printed).
bool SequencesLevel(const Options& opt, int clients,
                    const std::vector<v1::DecodeStepRequest>& requests, DecodeRegions* regions) {
  std::vector<std::unique_ptr<DecodeClient>> conns;
  std::vector<std::string> responses(
      static_cast<size_t>(clients));  // each client's first: the echo's size
  std::string error;
  if (regions != nullptr) regions->PoisonOutputs(&error);
  for (int c = 0; c < clients && error.empty(); ++c) {
    conns.push_back(DecodeClient::Create(opt.transport, c, &error));
    if (conns.back() != nullptr) conns.back()->Prepare(requests[size_t(c)]);
  }
  double wall_s = 0;
  std::vector<Sample> samples;
  if (error.empty()) {
    // Each client parses into the same message every step, as a client decoding in a loop would:
    // a parse clears it but keeps its results' submessages, so a 64-item step's ~200 of them are
    // not allocated and freed again on every call.
    std::vector<v1::DecodeStepResponse> last(static_cast<size_t>(clients));
    auto call = [&](int c, Sample* sample, std::string* failed) {
      v1::DecodeStepResponse& response = last[size_t(c)];
      if (!conns[size_t(c)]->Step(&response, failed)) return false;
      RecordTiming(response, sample);
      std::string& first = responses[size_t(c)];
      if (first.empty()) response.SerializeToString(&first);  // once: not in every step's time
      return true;
    };
    samples = RunClients(clients, opt.steps, opt.warmup, call, &wall_s, &error);
  }
  if (error.empty() && regions != nullptr) regions->CheckOutputs(&error);  // O really went there
  if (!error.empty()) {
    PrintError(SequencesPath(opt), Shape(opt), clients, error);
    return false;
  }
  const std::string echo = opt.echo.empty() ? "" : EchoFields(opt, clients, 1, requests, responses);
  PrintRow(SequencesPath(opt), Shape(opt), clients, samples, wall_s, echo);
  return true;
}

// One concurrency level with each client's step split into `split` parts (decode_split.h):
// client c sends requests[c * split + j], j < split, at once on connections of their own; a step
// lasts until its last part is answered, and its server timings are its slowest part's.
bool SplitLevel(const Options& opt, int clients, int split,
                const std::vector<v1::DecodeStepRequest>& requests, DecodeRegions* regions) {
  std::string error;
  if (regions != nullptr) regions->PoisonOutputs(&error);
  std::vector<std::unique_ptr<SplitDecodeClient>> conns;
  for (int c = 0; c < clients && error.empty(); ++c) {
    std::vector<const v1::DecodeStepRequest*> parts;
    for (int j = 0; j < split; ++j) parts.push_back(&requests[size_t(c * split + j)]);
    conns.push_back(std::make_unique<SplitDecodeClient>(opt.target, opt.token, c, parts));
  }
  std::vector<std::vector<v1::DecodeStepResponse>> last(static_cast<size_t>(clients));
  std::vector<std::string> firsts(requests.size());  // each part's first answer: the echo's sizes
  auto call = [&](int c, Sample* sample, std::string* failed) {
    std::vector<v1::DecodeStepResponse>& responses = last[size_t(c)];
    if (!conns[size_t(c)]->Step(&responses, failed)) return false;
    const v1::DecodeStepResponse* slowest = &responses[0];
    for (const v1::DecodeStepResponse& r : responses) {
      if (r.timing().total_us() > slowest->timing().total_us()) slowest = &r;
    }
    RecordTiming(*slowest, sample);
    for (int j = 0; j < split; ++j) {
      std::string& first = firsts[size_t(c * split + j)];
      if (first.empty()) responses[size_t(j)].SerializeToString(&first);
    }
    return true;
  };
  double wall_s = 0;
  std::vector<Sample> samples;
  if (error.empty()) samples = RunClients(clients, opt.steps, opt.warmup, call, &wall_s, &error);
  if (error.empty() && regions != nullptr) regions->CheckOutputs(&error);
  const std::string path = SequencesPath(opt) + ", split " + std::to_string(split);
  if (!error.empty()) {
    PrintError(path, Shape(opt), clients, error);
    return false;
  }
  const std::string echo =
      opt.echo.empty() ? "" : EchoFields(opt, clients, split, requests, firsts);
  PrintRow(path, Shape(opt), clients, samples, wall_s, echo);
  return true;
}

// The same shares as DecodeRequests, packed: client c's items carry ids only, its q/k/v are one
// tensor each of its sequences' rows (named in `regions`' packed layout when given).
std::vector<v1::DecodeStepRequest> PackedDecodeRequests(const std::vector<std::string>& ids,
                                                        int clients, const v1::Tensor& q,
                                                        const v1::Tensor& kv,
                                                        const DecodeRegions* regions,
                                                        bool answer_packed) {
  std::vector<v1::DecodeStepRequest> requests(static_cast<size_t>(clients));
  std::vector<int64_t> first(static_cast<size_t>(clients), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    const size_t c = i * size_t(clients) / ids.size();
    if (first[c] < 0) first[c] = int64_t(i);
    v1::DecodeItem* item = requests[c].add_items();
    item->set_sequence_id(ids[i]);
    item->set_layer(0);
  }
  auto repeat = [](const v1::Tensor& row, int64_t n) {  // [n, heads, d]: the row n times
    v1::Tensor t = row;
    t.set_shape(0, n);
    t.clear_data();
    for (int64_t i = 0; i < n; ++i) t.mutable_data()->append(row.data());
    return t;
  };
  for (size_t c = 0; c < requests.size(); ++c) {
    const int64_t n = requests[c].items_size();
    v1::PackedDecodeRows* p = requests[c].mutable_packed();
    *p->mutable_q() = repeat(q, n);
    *p->mutable_k() = repeat(kv, n);
    *p->mutable_v() = repeat(kv, n);
    p->set_answer_packed(answer_packed);
    if (regions != nullptr) regions->NamePacked(first[c], &requests[c]);
  }
  return requests;
}

bool BenchSequences(const Options& opt, std::mt19937* rng) {
  auto admin = v1::Sequences::NewStub(MakeChannel(opt.target, 1000));
  const std::vector<std::string> ids = CreateSequences(admin.get(), opt, rng);
  const v1::Tensor q = Bf16Tensor({1, kHeadsQ, kHeadDim}, rng);
  const v1::Tensor kv = Bf16Tensor({1, kHeadsKv, kHeadDim}, rng);
  std::unique_ptr<DecodeRegions> regions;
  bool ok = true;
  if (opt.transport.shm != "none") {
    std::string error;
    regions = DecodeRegions::Create(opt.transport, int64_t(ids.size()), q, kv, &error);
    if (regions == nullptr) {
      for (int clients : opt.concurrency)
        PrintError(SequencesPath(opt), Shape(opt), clients, error);
      ok = false;
    }
  }
  for (int clients : ok ? opt.concurrency : std::vector<int>{}) {
    for (int split : opt.split) {
      const int calls = clients * split;  // one request per call of a step
      const std::vector<v1::DecodeStepRequest> requests =
          opt.transport.packed
              ? PackedDecodeRequests(ids, calls, q, kv, regions.get(), opt.answer_packed)
              : DecodeRequests(ids, calls, q, kv, regions.get());
      ok = (split == 1 ? SequencesLevel(opt, clients, requests, regions.get())
                       : SplitLevel(opt, clients, split, requests, regions.get())) &&
           ok;
    }
  }
  regions.reset();  // unregistered before the sequences go
  Release(admin.get(), opt, ids);
  return ok;
}

// Client c's step through AttentionService: its share of the sequences with their whole K/V, in as
// few calls as fit under gRPC's message limit.
std::vector<v1::AttentionRequest> FullKvRequests(const Options& opt, int64_t batch,
                                                 std::mt19937* rng) {
  const int64_t per_seq = 2 * opt.context * kHeadsKv * kHeadDim * 2 + kHeadsQ * kHeadDim * 2;
  const int64_t fit = std::max<int64_t>(1, (kMaxMessage - (int64_t(1) << 20)) / per_seq);
  const int64_t calls = (batch + fit - 1) / fit;
  const int64_t per_call = (batch + calls - 1) / calls;
  std::vector<v1::AttentionRequest> requests;
  for (int64_t start = 0; start < batch; start += per_call) {
    const int64_t n = std::min(per_call, batch - start);
    v1::AttentionRequest r;
    *r.mutable_q() = Bf16Tensor({n, 1, kHeadsQ, kHeadDim}, rng);
    *r.mutable_k() = Bf16Tensor({n, opt.context, kHeadsKv, kHeadDim}, rng);
    *r.mutable_v() = Bf16Tensor({n, opt.context, kHeadsKv, kHeadDim}, rng);
    requests.push_back(std::move(r));
  }
  return requests;
}

bool BenchFullKv(const Options& opt, std::mt19937* rng) {
  bool ok = true;
  for (int clients : opt.concurrency) {
    std::vector<std::vector<v1::AttentionRequest>> requests;
    std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs;
    int64_t calls = 0;
    for (int c = 0; c < clients; ++c) {
      const int64_t share = (opt.sequences * (c + 1)) / clients - (opt.sequences * c) / clients;
      requests.push_back(FullKvRequests(opt, share, rng));
      calls += int64_t(requests.back().size());
      stubs.push_back(v1::AttentionService::NewStub(MakeChannel(opt.target, c)));
    }
    auto call = [&](int c, Sample* sample, std::string* failed) {
      for (const v1::AttentionRequest& r : requests[size_t(c)]) {
        grpc::ClientContext ctx;
        Authorize(&ctx, opt);
        v1::AttentionResponse response;
        grpc::Status s = stubs[size_t(c)]->Attention(&ctx, r, &response);
        if (!s.ok()) {
          *failed = std::to_string(int(s.error_code())) + ": " + s.error_message();
          return false;
        }
        sample->total_us += response.timing().total_us();
        sample->compute_us += response.timing().compute_us();
      }
      return true;
    };
    double wall_s = 0;
    std::string error;
    const std::vector<Sample> samples =
        RunClients(clients, opt.steps, opt.warmup, call, &wall_s, &error);
    if (!error.empty()) {
      PrintError("full_kv", Shape(opt), clients, error);
      ok = false;
      continue;
    }
    PrintRow("full_kv", Shape(opt), clients, samples, wall_s,
             ", \"calls_per_step\": " + std::to_string(calls));
  }
  return ok;
}

constexpr char kUsage[] =
    "usage: flashserve-decode-loadgen [--name=value ...]   (one JSON line per row on stdout)\n"
    "  --target=127.0.0.1:8001       flashserve's gRPC address (sequences are created there)\n"
    "  --token=T                     bearer token (server --auth_token_file): every gRPC call,\n"
    "                                the local socket's Hello and the echo calls carry it\n"
    "  --mode=sequences|full_kv      DecodeStep on sequences, or Attention with the whole K/V\n"
    "  --context=1024  --sequences=64  --concurrency=1,8 (each <= sequences)\n"
    "  --steps=200  --warmup=20\n"
    "  --local_socket=PATH           DecodeStep over the local transport (mode sequences)\n"
    "  --shm=none|system|cuda  --shm_device=0   q/k/v and O in regions (mode sequences; server\n"
    "                                --allow_client_shm; cuda: CUDA builds only)\n"
    "  --timeout_ms=60000            per call\n"
    "  --client_spin_us=0            local transport: poll this long (us) for each reply before\n"
    "                                blocking in recv (local_client.h; the row's path names it)\n"
    "  --packed=0|1|2                1: DecodeStepRequest.packed (one q/k/v/O place per step);\n"
    "                                2: also packed.answer_packed (O as one tensor in the answer)\n"
    "  --echo=HOST:PORT              flashserve-echo: the raw gRPC round trip of the same bytes\n"
    "                                per row\n"
    "  --split=1                     a list: each client's step also split into N DecodeStep\n"
    "                                calls sent at once on connections of their own, done when\n"
    "                                all have answered (gRPC only; rows \"..., split N\";\n"
    "                                concurrency x split <= sequences)\n";

const std::set<std::string> kKnownFlags = {
    "target",      "token",  "echo",           "mode",         "context", "sequences",
    "concurrency", "steps",  "warmup",         "local_socket", "shm",     "shm_device",
    "timeout_ms",  "packed", "client_spin_us", "split"};

int MaxOf(const std::vector<int>& values) {
  return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
}

void CheckOptions(const Options& opt, const flashserve::bench::Flags& flags) {
  const std::string& shm = opt.transport.shm;
  const bool valid =
      opt.context >= 1 && opt.sequences >= 1 && opt.steps >= 1 && opt.warmup >= 0 &&
      !opt.concurrency.empty() && (opt.mode == "sequences" || opt.mode == "full_kv") &&
      std::all_of(opt.concurrency.begin(), opt.concurrency.end(),
                  [&](int c) { return c >= 1 && c <= opt.sequences; }) &&
      (shm == "none" || shm == "system" || shm == "cuda") &&
      (opt.mode == "sequences" || (shm == "none" && opt.transport.local_socket.empty() &&
                                   opt.echo.empty() && !opt.transport.packed)) &&
      opt.transport.timeout_ms >= 0 && opt.transport.spin_us >= 0 &&
      opt.transport.spin_us <= 1000000 && !opt.split.empty() &&
      std::all_of(opt.split.begin(), opt.split.end(), [&](int s) {
        return s >= 1 && int64_t(s) * MaxOf(opt.concurrency) <= opt.sequences &&
               (s == 1 || (opt.mode == "sequences" && opt.transport.local_socket.empty()));
      });
  if (!valid) {
    flags.Fail(
        "bad flags (context, sequences, steps >= 1; 1 <= concurrency <= sequences; mode "
        "sequences or full_kv; shm none, system or cuda; --shm, --local_socket, --echo and "
        "--packed only with mode sequences; 0 <= client_spin_us <= 1000000; split >= 1, "
        "concurrency x split <= sequences, split > 1 only over gRPC in mode sequences)");
  }
}

Options ParseOptions(int argc, char** argv) {
  const flashserve::bench::Flags flags(argc, argv, kUsage, kKnownFlags);
  Options opt;
  opt.target = flags.Str("target", opt.target);
  opt.token = flags.Str("token", "");
  opt.echo = flags.Str("echo", "");
  opt.mode = flags.Str("mode", opt.mode);
  opt.context = flags.Int("context", 1024);
  opt.sequences = flags.Int("sequences", 64);
  opt.concurrency = flags.IntList("concurrency", "1,8");
  opt.split = flags.IntList("split", "1");
  opt.steps = int(flags.Int("steps", 200));
  opt.warmup = int(flags.Int("warmup", 20));
  opt.transport.target = opt.target;
  opt.transport.token = opt.token;
  opt.transport.local_socket = flags.Str("local_socket", "");
  opt.transport.shm = flags.Str("shm", "none");
  opt.transport.device = int(flags.Int("shm_device", 0));
  opt.transport.timeout_ms = int(flags.Int("timeout_ms", 60000));
  opt.transport.packed = flags.Int("packed", 0) != 0;
  opt.answer_packed = flags.Int("packed", 0) == 2;
  opt.transport.spin_us = flags.Int("client_spin_us", 0);
  CheckOptions(opt, flags);
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseOptions(argc, argv);
  std::mt19937 rng(12345);
  const bool ok = opt.mode == "sequences" ? BenchSequences(opt, &rng) : BenchFullKv(opt, &rng);
  return ok ? 0 : 3;  // 3: some rows failed (printed as error rows)
}
