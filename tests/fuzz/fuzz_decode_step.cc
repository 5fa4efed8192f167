// libFuzzer target: a DecodeStep as the Sequences edge and the KV cache run it, on the CPU store:
// bytes -> DecodeStepRequest (protobuf) -> BuildDecodeStep (edge checks; per-item or packed
// tensors) -> SequenceCache::PrepareStep against three live sequences -> CpuKvStore::Attend.
//
// Item ids "s0", "s1", "s2" name the sequences created for each input (server ids are random, so
// a fuzzer could never guess one); any other id is unknown. The sequences:
//   s0: FLOAT16, 2 layers, heads 4:2, head_dim 8; layer 0 holds 5 rows, layer 1 none
//   s1: BFLOAT16, 1 layer, heads 2:1, head_dim 4; 3 rows
//   s2: FLOAT16, 1 layer, heads 4:2, head_dim 8 (s0's shape, so steps over both can run); 4 rows
// Pages hold 4 tokens and a layer at most kMaxTokens, so steps end mid-page, cross pages and
// run past the limit.
//
// Oracles:
//  1. The edge refuses only with INVALID_ARGUMENT; the cache with INVALID_ARGUMENT, NOT_FOUND or
//     RESOURCE_EXHAUSTED; an accepted step's launch succeeds.
//  2. Every item's q / k / v rows lie inside the request's own bytes.
//  3. All or nothing: a refused step leaves every layer's length as it was; an accepted one grows
//     each (sequence, layer) by its item's k rows.
//  4. With finite inputs and moderate logits, O and LSE match the fp64 reference over the layer's
//     whole K/V (prefix plus the rows this step appended), within one unit in the last place of
//     the dtype (the CPU kernel accumulates in fp32 and rounds once); an empty layer gives O = 0
//     and LSE = -inf.
//  5. Releasing the sequences returns every page (the pool is empty after each input).
//  6. With an answer buffer (a third of the inputs), the encoded answer parses back to one result
//     per item whose O (and LSE) are the bytes the launch wrote (edge/sequences/answer_buffer.h);
//     with packed.answer_packed, to one O and one LSE tensor of those bytes back to back.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "edge/sequences/answer_buffer.h"
#include "edge/sequences/sequences_decode.h"
#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/reference_attention.h"
#include "flashserve/v1/sequences.pb.h"
#include "fuzz_check.h"
#include "kvcache/sequence_cache.h"
#include "runtime/cpu_kv_store.h"

namespace {

using namespace flashserve;
using kernels::DType;
using kvcache::HostRows;
using Bits = std::vector<uint16_t>;

constexpr int kMaxItems = 8;
constexpr int64_t kMaxTokens = 24;
constexpr int kNames = 3;

struct Fixture {
  std::unique_ptr<CpuKvStore> store;
  std::unique_ptr<kvcache::SequenceCache> cache;
};

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    f->store = *CpuKvStore::Create(kvcache::PageAllocator::kSlabBytes, nullptr);
    kvcache::KvCacheOptions options;
    options.capacity_bytes = kvcache::PageAllocator::kSlabBytes;
    options.page_tokens = 4;
    options.ttl = absl::ZeroDuration();  // never evict
    options.max_sequence_tokens = kMaxTokens;
    f->cache = *kvcache::SequenceCache::Create(options, f->store.get(), nullptr);
    return f;
  }();
  return *fixture;
}

kvcache::SequenceShape ShapeOf(int name) {
  kvcache::SequenceShape s;
  s.num_layers = name == 0 ? 2 : 1;
  s.heads_q = name == 1 ? 2 : 4;
  s.heads_kv = name == 1 ? 1 : 2;
  s.head_dim = name == 1 ? 4 : 8;
  s.dtype = name == 1 ? DType::kBFloat16 : DType::kFloat16;
  return s;
}

int PrefixRows(int name, int layer) { return name == 0 ? (layer == 0 ? 5 : 0) : name + 2; }

// Deterministic small values in the sequence's dtype.
Bits Values(int64_t count, DType dtype, uint32_t seed) {
  Bits bits(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    seed = seed * 1664525u + 1013904223u;
    kernels::store_element(bits.data(), i, dtype, float(int(seed >> 24) - 128) / 64.f);
  }
  return bits;
}

// What a layer holds, densely (K and V rows in order).
struct Dense {
  Bits k, v;
};

struct Live {
  std::string id[kNames];
  std::map<std::pair<int, int>, Dense> layers;  // (name, layer) -> rows
};

HostRows RowsOf(const Bits& bits, const kvcache::SequenceShape& s) {
  HostRows r;
  r.dtype = s.dtype;
  r.heads = s.heads_kv;
  r.head_dim = s.head_dim;
  r.rows = int64_t(bits.size()) / (s.heads_kv * s.head_dim);
  r.data = bits.data();
  return r;
}

Live CreateSequences(kvcache::SequenceCache* cache) {
  Live live;
  for (int name = 0; name < kNames; ++name) {
    const kvcache::SequenceShape s = ShapeOf(name);
    kvcache::CreateRequest request;
    request.shape = s;
    for (int layer = 0; layer < s.num_layers; ++layer) {
      Dense& dense = live.layers[{name, layer}];
      const int64_t n = PrefixRows(name, layer) * s.heads_kv * s.head_dim;
      dense.k = Values(n, s.dtype, uint32_t(17 * name + layer));
      dense.v = Values(n, s.dtype, uint32_t(31 * name + layer + 5));
      if (n > 0) request.prefix.push_back({layer, RowsOf(dense.k, s), RowsOf(dense.v, s)});
    }
    absl::StatusOr<kvcache::SequenceStatus> created = cache->CreateSequence(request);
    FUZZ_CHECK(created.ok(), created.status().ToString());
    live.id[name] = created->id;
  }
  return live;
}

std::vector<int64_t> Lengths(kvcache::SequenceCache* cache, const Live& live) {
  std::vector<int64_t> lengths;
  for (const std::string& id : live.id) {
    absl::StatusOr<kvcache::SequenceStatus> status = cache->Info(id);
    FUZZ_CHECK(status.ok(), status.status().ToString());
    lengths.insert(lengths.end(), status->lengths.begin(), status->lengths.end());
  }
  return lengths;
}

// The sequence an item id names (-1: none of ours).
int NameOf(const std::string& id) {
  for (int name = 0; name < kNames; ++name) {
    if (id == "s" + std::to_string(name)) return name;
  }
  return -1;
}

// Oracle 2: rows of `r` lie in some tensor's data of the request.
bool InRequest(const HostRows& r, const std::vector<const std::string*>& datas) {
  if (r.rows == 0) return true;
  const char* begin = static_cast<const char*>(r.data);
  const char* end = begin + r.rows * r.heads * r.head_dim * int64_t(kernels::dtype_size(r.dtype));
  for (const std::string* data : datas) {
    if (begin >= data->data() && end <= data->data() + data->size()) return true;
  }
  return false;
}

std::vector<const std::string*> RequestDatas(const v1::DecodeStepRequest& request) {
  std::vector<const std::string*> datas;
  for (const v1::DecodeItem& item : request.items()) {
    for (const v1::Tensor* t : {&item.q(), &item.k(), &item.v()}) datas.push_back(&t->data());
  }
  const v1::PackedDecodeRows& packed = request.packed();
  for (const v1::Tensor* t : {&packed.q(), &packed.k(), &packed.v()}) datas.push_back(&t->data());
  return datas;
}

// The largest |x| of the rows; infinity when one is not finite.
double MaxAbs(const void* data, int64_t count, DType dtype) {
  double m = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double x = std::abs(double(kernels::load_element(data, i, dtype)));
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    m = std::max(m, x);
  }
  return m;
}

void AppendRows(const HostRows& rows, Bits* to) {
  const auto* p = static_cast<const uint16_t*>(rows.data);
  to->insert(to->end(), p, p + rows.rows * rows.heads * rows.head_dim);
}

// Oracle 4 for one item.
void CheckItem(const kvcache::SequenceShape& s, const Dense& layer, const kvcache::PagedItem& item,
               bool causal, float scale) {
  const int64_t row = int64_t(s.heads_kv) * s.head_dim;
  const int64_t length = int64_t(layer.k.size()) / row;
  FUZZ_CHECK(item.length == length, "the launch's length is not the layer's");
  const int64_t q_count = int64_t(item.rows_q) * s.heads_q * s.head_dim;
  const double bound = MaxAbs(item.q, q_count, s.dtype) *
                       MaxAbs(layer.k.data(), length * row, s.dtype) * scale * s.head_dim;
  const double v_max = MaxAbs(layer.v.data(), length * row, s.dtype);
  if (!(bound <= 32) || !std::isfinite(v_max)) return;  // fp32 logits would round: no oracle
  std::vector<double> ref_o(size_t(q_count), 0.0);
  std::vector<double> ref_lse(size_t(s.heads_q * item.rows_q),
                              -std::numeric_limits<double>::infinity());
  if (length > 0) {
    kernels::AttentionParams p = kernels::make_contiguous_params(
        s.dtype, 1, item.rows_q, int(length), s.heads_q, s.heads_kv, s.head_dim, causal, scale);
    p.q = item.q;
    p.k = layer.k.data();
    p.v = layer.v.data();
    kernels::reference::attention_fp64(p, &ref_o, &ref_lse);
  }
  const double ulp = s.dtype == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  for (int64_t i = 0; i < q_count; ++i) {
    const double o = kernels::load_element(item.out, i, s.dtype);
    const double tol = ulp * std::abs(ref_o[size_t(i)]) + 1e-5 * std::max(1.0, v_max);
    FUZZ_CHECK(std::abs(o - ref_o[size_t(i)]) <= tol, "out[" + std::to_string(i) +
                                                          "] = " + std::to_string(o) + " vs " +
                                                          std::to_string(ref_o[size_t(i)]));
  }
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    const double l = item.lse[i], r = ref_lse[i];
    const bool same_inf = std::isinf(r) && l == r;
    FUZZ_CHECK(
        same_inf || std::abs(l - r) <= 1e-4 * (1 + std::abs(r)),
        "lse[" + std::to_string(i) + "] = " + std::to_string(l) + " vs " + std::to_string(r));
  }
}

// Runs an accepted call's step; oracles 1, 3 and 4.
void RunStep(DecodeCall* call, kvcache::SequenceCache* cache, Live* live) {
  std::vector<int> names;
  for (kvcache::StepItem& item : call->items) {
    const int name = NameOf(item.id);
    names.push_back(name);
    if (name >= 0) item.id = live->id[name];
  }
  const std::vector<int64_t> before = Lengths(cache, *live);
  absl::StatusOr<kvcache::StepPlan> plan = cache->PrepareStep(call->items);
  if (!plan.ok()) {
    const absl::StatusCode code = plan.status().code();
    // ABORTED: an expected_length the layer's length contradicts.
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
                   code == absl::StatusCode::kResourceExhausted ||
                   code == absl::StatusCode::kAborted,
               plan.status().ToString());
    FUZZ_CHECK(Lengths(cache, *live) == before, "a refused step changed a length");
    return;
  }
  std::map<std::pair<int, int>, int64_t> grown;
  for (size_t i = 0; i < call->items.size(); ++i) {
    FUZZ_CHECK(names[i] >= 0, "an unknown id was accepted");
    const kvcache::StepItem& item = call->items[i];
    // expected_length found the rows there (taken for an earlier try's): the layer keeps its own.
    if (plan->already_appended[i]) continue;
    grown[{names[i], item.layer}] += item.k.rows;
    Dense& dense = live->layers.at({names[i], item.layer});
    AppendRows(item.k, &dense.k);
    AppendRows(item.v, &dense.v);
  }
  kvcache::PagedBatch& batch = plan->batch;
  batch.causal = call->causal;
  batch.softmax_scale = call->softmax_scale;
  std::vector<std::vector<float>> lse(batch.items.size());
  for (size_t i = 0; i < batch.items.size(); ++i) {
    batch.items[i].out = call->out[i];
    lse[i].assign(size_t(batch.items[i].rows_q * batch.shape.heads_q), NAN);  // poisoned
    batch.items[i].lse = lse[i].data();
  }
  kvcache::AttendInfo info;
  const absl::Status attended = cache->store()->Attend(batch, &info);
  FUZZ_CHECK(attended.ok(), attended.ToString());
  for (size_t i = 0; i < batch.items.size(); ++i) {
    const kvcache::SequenceShape s = ShapeOf(names[i]);
    CheckItem(s, live->layers.at({names[i], call->items[i].layer}), batch.items[i], batch.causal,
              batch.softmax_scale);
  }
  const std::vector<int64_t> after = Lengths(cache, *live);
  size_t at = 0;
  for (int name = 0; name < kNames; ++name) {
    for (int layer = 0; layer < ShapeOf(name).num_layers; ++layer, ++at) {
      const auto it = grown.find({name, layer});
      FUZZ_CHECK(after[at] == before[at] + (it == grown.end() ? 0 : it->second),
                 "an accepted step grew a layer by other than its rows");
    }
  }
}

// Half the inputs (even sizes) get each tensor's data cut or padded to what its shape says, so a
// mutated shape or row count still makes a well-formed step (the other half keep the mismatches
// the edge must refuse).
void FitData(v1::Tensor* t) {
  int64_t n = 1;
  for (int64_t d : t->shape()) {
    if (d < 0 || d > 4096 || n * d > 4096) return;  // not a small shape: left as it is
    n *= d;
  }
  const size_t old_size = t->data().size();
  t->mutable_data()->resize(size_t(n) * 2);
  const DType dtype = t->dtype() == v1::BFLOAT16 ? DType::kBFloat16 : DType::kFloat16;
  const Bits fill = Values(n, dtype, uint32_t(old_size));
  for (size_t i = old_size / 2; i < size_t(n); ++i)
    std::memcpy(&(*t->mutable_data())[2 * i], &fill[i], 2);
}

// Fits the tensors the request has (mutable_* would create absent ones: k unset means attend only).
void FitAll(v1::DecodeStepRequest* request) {
  for (v1::DecodeItem& item : *request->mutable_items()) {
    if (item.has_q()) FitData(item.mutable_q());
    if (item.has_k()) FitData(item.mutable_k());
    if (item.has_v()) FitData(item.mutable_v());
  }
  if (!request->has_packed()) return;
  v1::PackedDecodeRows* packed = request->mutable_packed();
  if (packed->has_q()) FitData(packed->mutable_q());
  if (packed->has_k()) FitData(packed->mutable_k());
  if (packed->has_v()) FitData(packed->mutable_v());
}

PinnedPool* AnswerPool() {
  static PinnedPool* pool = [] {
    PinnedPoolOptions options;
    options.capacity_bytes = size_t{256} << 20;
    options.page_locked = false;
    return PinnedPool::Create(options, std::make_unique<HeapAllocator>())->release();
  }();
  return pool;
}

// Oracle 6: the answer's pieces parse to one result per item carrying exactly the bytes at the
// call's out / lse places -- or, for a packed answer (packed.answer_packed), to results without
// them and one O and one LSE tensor holding every item's bytes back to back.
void CheckAnswer(const v1::DecodeStepRequest& request, v1::DecodeStepResponse* response,
                 const AnswerBuffer& buffer, const DecodeCall& call) {
  const AnswerPieces pieces = EncodeDecodeStepAnswer(response, &buffer);
  std::string wire;
  for (const AnswerPieces::Piece& piece : pieces.pieces) wire += pieces.View(piece, &buffer);
  v1::DecodeStepResponse parsed;
  FUZZ_CHECK(parsed.ParseFromString(wire), "the encoded answer does not parse");
  FUZZ_CHECK(parsed.results_size() == int(call.items.size()), "one result per item");
  const bool packed = request.has_packed() && request.packed().answer_packed();
  FUZZ_CHECK(parsed.has_packed() == packed, "a packed answer exactly when asked for");
  std::string all_out, all_lse;  // every item's, back to back
  for (size_t i = 0; i < call.items.size(); ++i) {
    const HostRows& q = call.items[i].q;
    const size_t out_bytes = size_t(q.rows * q.heads * q.head_dim * 2);
    const size_t lse_bytes = size_t(q.rows * q.heads * 4);
    const v1::DecodeResult& result = parsed.results(int(i));
    FUZZ_CHECK(result.has_out() != packed && result.has_lse() == (!packed && !call.lse.empty()),
               "a packed answer's results carry no tensors, the others theirs");
    all_out.append(static_cast<const char*>(call.out[i]), out_bytes);
    if (!call.lse.empty()) all_lse.append(reinterpret_cast<const char*>(call.lse[i]), lse_bytes);
    if (packed) continue;
    FUZZ_CHECK(result.out().data() == all_out.substr(all_out.size() - out_bytes),
               "an answer's O is not what the launch wrote");
    FUZZ_CHECK(
        call.lse.empty() || result.lse().data() == all_lse.substr(all_lse.size() - lse_bytes),
        "an answer's LSE is not what the launch wrote");
  }
  if (!packed) return;
  FUZZ_CHECK(parsed.packed().out().data() == all_out, "a packed answer's O is not the launch's");
  FUZZ_CHECK(
      parsed.packed().has_lse() == !call.lse.empty() && parsed.packed().lse().data() == all_lse,
      "a packed answer's LSE is not the launch's");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  v1::DecodeStepRequest request;
  if (!request.ParseFromArray(data, int(size))) return 0;
  if (size % 2 == 0) FitAll(&request);
  v1::DecodeStepResponse response;
  AnswerPlace answer{size % 3 == 0 ? AnswerPool() : nullptr, nullptr};
  absl::StatusOr<std::shared_ptr<DecodeCall>> call =
      BuildDecodeStep(request, kMaxItems, /*shm=*/nullptr, &response, &answer);
  if (!call.ok()) {
    FUZZ_CHECK(call.status().code() == absl::StatusCode::kInvalidArgument,
               call.status().ToString());
    return 0;
  }
  const std::vector<const std::string*> datas = RequestDatas(request);
  for (const kvcache::StepItem& item : (*call)->items) {
    for (const HostRows* rows : {&item.q, &item.k, &item.v}) {
      FUZZ_CHECK(InRequest(*rows, datas), "an item's rows lie outside the request");
    }
  }
  Fixture& f = TheFixture();
  Live live = CreateSequences(f.cache.get());
  RunStep(call->get(), f.cache.get(), &live);
  if (answer.buffer != nullptr) CheckAnswer(request, &response, *answer.buffer, **call);
  const std::vector<std::string> ids(std::begin(live.id), std::end(live.id));
  FUZZ_CHECK(f.cache->Release(ids).empty(), "a live sequence was not found");
  const kvcache::CacheStats stats = f.cache->Stats();
  FUZZ_CHECK(stats.sequences == 0 && stats.used_bytes == 0 && stats.pages_used == 0,
             "pages left after every sequence was released");
  return 0;
}
