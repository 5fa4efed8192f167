#include "edge/sequences/sequences_decode.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "edge/sequences/sequences_convert.h"
#include "edge/sequences/sequences_packed.h"
#include "edge/sequences/sequences_shm.h"
#include "memory/receive_arena.h"

namespace flashserve {

namespace {

absl::StatusOr<kvcache::StepItem> ItemFrom(const std::string& id, int layer, const v1::Tensor& q,
                                           const v1::Tensor& k, const v1::Tensor& v,
                                           SequenceShm* shm) {
  kvcache::StepItem item;
  item.id = id;
  item.layer = layer;
  absl::StatusOr<kvcache::HostRows> rows = DecodeTensorRows(q, "q", false, shm);
  if (!rows.ok()) return rows.status();
  if (rows->rows < 1 || rows->rows > kvcache::kMaxQueryRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("q must have 1..", kvcache::kMaxQueryRows, " rows, got ", rows->rows));
  }
  item.q = *rows;
  if (rows = DecodeTensorRows(k, "k", true, shm); !rows.ok()) return rows.status();
  item.k = *rows;
  if (rows = DecodeTensorRows(v, "v", true, shm); !rows.ok()) return rows.status();
  item.v = *rows;
  return item;
}

// The items of an unpacked step: each with its own q/k/v.
absl::StatusOr<std::vector<kvcache::StepItem>> EachItem(const v1::DecodeStepRequest& request,
                                                        SequenceShm* shm) {
  std::vector<kvcache::StepItem> items;
  items.reserve(size_t(request.items_size()));
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::DecodeItem& in = request.items(i);
    absl::StatusOr<kvcache::StepItem> item =
        ItemFrom(in.sequence_id(), in.layer(), in.q(), in.k(), in.v(), shm);
    if (!item.ok()) {
      return absl::Status(item.status().code(),
                          absl::StrCat("item ", i, ": ", item.status().message()));
    }
    items.push_back(*std::move(item));
  }
  return items;
}

// Each item's expected_length (packed or not: a scalar of the item itself).
absl::Status SetExpectedLengths(const v1::DecodeStepRequest& request,
                                std::vector<kvcache::StepItem>* items) {
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::DecodeItem& in = request.items(i);
    absl::StatusOr<int64_t> expected =
        ExpectedLengthFrom(in.has_expected_length(), in.expected_length());
    if (!expected.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", i, ": ", expected.status().message()));
    }
    (*items)[size_t(i)].expected_length = *expected;
  }
  return absl::OkStatus();
}

// places[i] = at, where a shorter vector means kHost for the rest (DecodeCall::out_at).
void SetPlace(std::vector<kvcache::BytesAt>* places, size_t i, kvcache::BytesAt at) {
  if (places->size() <= i) places->resize(i + 1, kvcache::BytesAt::kHost);
  (*places)[i] = at;
}

// One item's O and LSE: into the regions it names, else into the response.
absl::Status AddItemOutputs(const v1::DecodeItem& in, const kvcache::StepItem& item,
                            bool return_lse, SequenceShm* shm, v1::DecodeResult* result,
                            DecodeCall* call, AnswerBuffer* answer) {
  ItemOutputPlaces places;
  if (in.has_out_shm()) {
    absl::StatusOr<ShmPlace> at = ShmOutput(in.out_shm(), "out_shm", OutBytes(item.q), 1, shm);
    if (!at.ok()) return at.status();
    places.out = at->data;
    places.out_at = at->at;
  }
  if (return_lse && in.has_lse_shm()) {
    absl::StatusOr<ShmPlace> at = ShmOutput(in.lse_shm(), "lse_shm", LseBytes(item.q), 4, shm);
    if (!at.ok()) return at.status();
    places.lse = at->data;
    places.lse_at = at->at;
  }
  AddItemOutputsAt(item, return_lse, places, result->mutable_out(),
                   return_lse ? result->mutable_lse() : nullptr, call, answer);
  return absl::OkStatus();
}

absl::Status AddStepOutputs(const v1::DecodeStepRequest& request, DecodeCall* call,
                            SequenceShm* shm, v1::DecodeStepResponse* response,
                            AnswerBuffer* answer) {
  response->mutable_results()->Reserve(request.items_size());
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::DecodeItem& in = request.items(i);
    const bool uses_shm = in.has_out_shm() || (request.return_lse() && in.has_lse_shm());
    if (uses_shm && shm == nullptr) {
      return absl::InvalidArgumentError(
          "out_shm / lse_shm given where shared memory is unsupported");
    }
    absl::Status s = AddItemOutputs(in, call->items[size_t(i)], request.return_lse(), shm,
                                    response->add_results(), call, answer);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message()));
  }
  return shm == nullptr ? absl::OkStatus() : CheckShmOverlap(*shm);
}

// Whether some O or LSE travels in the answer (an output in a region does not).
bool SomeOutputInAnswer(const v1::DecodeStepRequest& request) {
  const bool lse = request.return_lse();
  if (request.has_packed()) {
    return !request.packed().has_out_shm() || (lse && !request.packed().has_lse_shm());
  }
  for (const v1::DecodeItem& item : request.items()) {
    if (!item.has_out_shm() || (lse && !item.has_lse_shm())) return true;
  }
  return false;
}

// A buffer with room for every item's O and, with return_lse, LSE; null when none travels in the
// answer or the pool has no room.
std::shared_ptr<AnswerBuffer> AcquireAnswerBuffer(const v1::DecodeStepRequest& request,
                                                  const std::vector<kvcache::StepItem>& items,
                                                  PinnedPool* pool) {
  if (!SomeOutputInAnswer(request)) return nullptr;
  size_t out_bytes = 0, lse_bytes = 0;
  for (const kvcache::StepItem& item : items) {
    out_bytes += size_t(OutBytes(item.q));
    if (request.return_lse()) lse_bytes += size_t(LseBytes(item.q));
  }
  return AnswerBuffer::Acquire(pool, out_bytes, lse_bytes);
}

void FillTiming(const DecodeReport& report, absl::Time received, v1::Timing* timing) {
  timing->set_prepare_us(report.prepare_us);
  timing->set_queue_us(report.queue_us);
  timing->set_stage_us(report.append_us);
  timing->set_compute_us(report.compute_us);
  timing->set_h2d_us(report.h2d_us);
  timing->set_d2h_us(report.d2h_us);
  timing->set_kernel_us(report.kernel_us);
  timing->set_total_us(absl::ToInt64Microseconds(absl::Now() - received));
}

}  // namespace

absl::StatusOr<kvcache::HostRows> DecodeTensorRows(const v1::Tensor& tensor, const char* name,
                                                   bool optional, SequenceShm* shm) {
  const bool in_region = tensor.has_shm() && shm != nullptr;
  absl::StatusOr<kvcache::HostRows> rows =
      in_region ? ShmRows(tensor, name, shm) : RowsFromTensor(tensor, name, optional);
  // Bounded before anything is sized from them (O is q's size): a q in a region claiming
  // [16, 8192, 24576] had 6 GiB of O allocated before its sequence was looked up (audit).
  if (rows.ok() && (rows->heads > kvcache::kMaxHeads || rows->head_dim > kvcache::kMaxHeadDim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": [", rows->rows, ", ", rows->heads, ", ", rows->head_dim, "]: heads at most ",
        kvcache::kMaxHeads, " and head_dim at most ", kvcache::kMaxHeadDim));
  }
  if (in_region) return rows;
  // Rows in the message whose bytes the server's malloc took from the page-locked receive arena
  // (buffer-sized strings, e.g. a packed step's q): the GPU store reads them where they are
  // instead of copying them into its staging first.
  if (rows.ok() && rows->data != nullptr &&
      ReceiveArena::PageLockedHolds(tensor.data().data(), tensor.data().size())) {
    rows->at = kvcache::BytesAt::kPageLocked;
  }
  return rows;
}

void AddItemOutputsAt(const kvcache::StepItem& item, bool return_lse, ItemOutputPlaces places,
                      v1::Tensor* out, v1::Tensor* lse, DecodeCall* call, AnswerBuffer* answer) {
  const int64_t rows = item.q.rows, heads = item.q.heads, dim = item.q.head_dim;
  const v1::DType dtype = static_cast<v1::DType>(item.q.dtype);
  if (places.out == nullptr && answer != nullptr) {
    places.out = answer->TakeOut(size_t(OutBytes(item.q)), out);
    places.out_at = answer->at();
  }
  if (places.out != nullptr) {
    if (out != nullptr) {
      out->set_dtype(dtype);
      for (int64_t d : {rows, heads, dim}) out->add_shape(d);
    }
    SetPlace(&call->out_at, call->out.size(), places.out_at);
    call->out.push_back(places.out);
  } else {
    call->out.push_back(PrepareOutput(out, dtype, {rows, heads, dim}, 2));
  }
  if (!return_lse) return;
  if (places.lse == nullptr && answer != nullptr) {
    places.lse = answer->TakeLse(size_t(LseBytes(item.q)), lse);
    places.lse_at = answer->at();
  }
  if (places.lse != nullptr) {
    if (lse != nullptr) {
      lse->set_dtype(v1::FLOAT32);
      for (int64_t d : {heads, rows}) lse->add_shape(d);
    }
    SetPlace(&call->lse_at, call->lse.size(), places.lse_at);
    call->lse.push_back(reinterpret_cast<float*>(places.lse));
  } else {
    call->lse.push_back(
        reinterpret_cast<float*>(PrepareOutput(lse, v1::FLOAT32, {heads, rows}, 4)));
  }
}

absl::StatusOr<std::shared_ptr<DecodeCall>> BuildAttend(const v1::AttendRequest& request,
                                                        v1::AttendResponse* response) {
  absl::StatusOr<kvcache::StepItem> item =
      ItemFrom(request.sequence_id(), request.layer(), request.q(), v1::Tensor(), v1::Tensor(),
               /*shm=*/nullptr);
  if (!item.ok()) return item.status();
  absl::StatusOr<float> scale =
      ScaleFrom(request.has_softmax_scale(), request.softmax_scale(), item->q.head_dim);
  if (!scale.ok()) return scale.status();
  auto call = std::make_shared<DecodeCall>();
  call->causal = request.causal();
  call->softmax_scale = *scale;
  AddItemOutputsAt(*item, request.return_lse(), ItemOutputPlaces(), response->mutable_out(),
                   request.return_lse() ? response->mutable_lse() : nullptr, call.get(),
                   /*answer=*/nullptr);
  call->items.push_back(*std::move(item));
  return call;
}

absl::StatusOr<std::shared_ptr<DecodeCall>> BuildDecodeStep(const v1::DecodeStepRequest& request,
                                                            int max_items, SequenceShm* shm,
                                                            v1::DecodeStepResponse* response,
                                                            AnswerPlace* answer) {
  if (request.items_size() < 1 || request.items_size() > max_items) {
    return absl::InvalidArgumentError(absl::StrCat("a DecodeStep holds 1..", max_items,
                                                   " items (--max_batch_sequences), got ",
                                                   request.items_size()));
  }
  auto call = std::make_shared<DecodeCall>();
  call->causal = request.causal();
  absl::StatusOr<std::vector<kvcache::StepItem>> items =
      request.has_packed() ? PackedItems(request, shm) : EachItem(request, shm);
  if (!items.ok()) return items.status();
  call->items = *std::move(items);
  if (absl::Status s = SetExpectedLengths(request, &call->items); !s.ok()) return s;
  absl::StatusOr<float> scale =
      ScaleFrom(request.has_softmax_scale(), request.softmax_scale(), call->items[0].q.head_dim);
  if (!scale.ok()) return scale.status();
  call->softmax_scale = *scale;
  AnswerBuffer* buffer = nullptr;
  if (answer != nullptr && answer->pool != nullptr) {
    answer->buffer = AcquireAnswerBuffer(request, call->items, answer->pool);
    buffer = answer->buffer.get();
  }
  const absl::Status outputs = request.has_packed()
                                   ? AddPackedOutputs(request, shm, call.get(), response, buffer)
                                   : AddStepOutputs(request, call.get(), shm, response, buffer);
  if (!outputs.ok()) return outputs;
  if (shm != nullptr) {
    call->shm_system_inputs = shm->system_inputs;
    call->shm_cuda_inputs = shm->cuda_inputs;
    // Any region of the call may fault (an input or only O / LSE): the call then fails, so the
    // rows it appended must not stay behind as if it had not run (FinishSequenceShm).
    if (!shm->regions_leased.empty()) {
      for (size_t i = 0; i < call->items.size(); ++i) {
        if (call->items[i].k.rows > 0) shm->fed.push_back({i, call->items[i].id});
      }
    }
  }
  return call;
}

void FillAttend(const DecodeReport& report, absl::Time received, v1::AttendResponse* response) {
  if (!report.lengths.empty()) response->set_length(report.lengths[0]);
  response->set_kernel(report.kernel);
  FillTiming(report, received, response->mutable_timing());
}

void FillDecodeStep(const DecodeReport& report, absl::Time received,
                    v1::DecodeStepResponse* response) {
  for (size_t i = 0; i < report.lengths.size() && int(i) < response->results_size(); ++i) {
    response->mutable_results(int(i))->set_length(report.lengths[i]);
    if (i < report.already_appended.size() && report.already_appended[i])
      response->mutable_results(int(i))->set_already_appended(true);
  }
  response->set_kernel(report.kernel);
  response->set_batched_calls(report.batched_calls);
  FillTiming(report, received, response->mutable_timing());
}

void FillSequenceInfo(const kvcache::SequenceStatus& status, v1::SequenceInfo* info) {
  info->set_sequence_id(status.id);
  info->set_num_layers(status.shape.num_layers);
  info->set_heads_q(status.shape.heads_q);
  info->set_heads_kv(status.shape.heads_kv);
  info->set_head_dim(status.shape.head_dim);
  info->set_dtype(static_cast<v1::DType>(status.shape.dtype));
  for (int64_t length : status.lengths) info->add_layer_lengths(length);
  info->set_max_tokens(status.max_tokens);
  info->set_idle_ms(absl::ToInt64Milliseconds(status.idle));
  info->set_bytes(status.bytes);
  info->set_label(status.label);
}

void FillPoolInfo(SequenceRuntime* sequences, v1::KvPoolInfo* info) {
  const kvcache::CacheStats stats = sequences->cache().Stats();
  const SequenceRuntimeOptions& options = sequences->options();
  info->set_backend(std::string(sequences->backend_kind()));
  info->set_capacity_bytes(stats.capacity_bytes);
  info->set_used_bytes(stats.used_bytes);
  info->set_page_tokens(options.cache.page_tokens);
  info->set_pages_used(stats.pages_used);
  info->set_sequences(int32_t(stats.sequences));
  info->set_max_sequences(options.cache.max_sequences);
  info->set_max_sequence_tokens(options.cache.max_sequence_tokens);
  info->set_ttl_ms(absl::ToInt64Milliseconds(options.cache.ttl));
  info->set_evictions(stats.evictions);
  info->set_batch_window_us(options.batch_window_us);
}

}  // namespace flashserve
