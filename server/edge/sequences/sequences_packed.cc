#include "edge/sequences/sequences_packed.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "edge/sequences/answer_buffer.h"
#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_shm.h"
#include "kvcache/sequence_cache.h"

namespace flashserve {

namespace {

// Per-item row counts: `given` (one per item), or `fallback` for every item when empty.
absl::StatusOr<std::vector<int64_t>> RowCounts(
    const google::protobuf::RepeatedField<int32_t>& given, const char* name, int items, int64_t min,
    int64_t max, const std::vector<int64_t>& fallback) {
  if (given.empty()) return fallback;
  if (given.size() != items) {
    return absl::InvalidArgumentError(
        absl::StrCat("packed.", name, " has ", given.size(), " entries for ", items, " items"));
  }
  std::vector<int64_t> counts(given.begin(), given.end());
  for (int i = 0; i < items; ++i) {
    if (counts[size_t(i)] < min || counts[size_t(i)] > max) {
      return absl::InvalidArgumentError(absl::StrCat("packed.", name, "[", i, "] must be in ", min,
                                                     "..", max, ", got ", counts[size_t(i)]));
    }
  }
  return counts;
}

absl::Status CheckTotal(const std::vector<int64_t>& counts, const kvcache::HostRows& all,
                        const char* name) {
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  if (total != all.rows) {
    return absl::InvalidArgumentError(absl::StrCat("packed.", name, " has ", all.rows,
                                                   " rows, the items' counts add up to ", total));
  }
  return absl::OkStatus();
}

// Rows [first, first + rows) of `all` (a pointer inside its span even when rows is 0).
kvcache::HostRows Slice(const kvcache::HostRows& all, int64_t first, int64_t rows) {
  kvcache::HostRows slice = all;
  slice.rows = rows;
  slice.data = static_cast<const char*>(all.data) + first * all.heads * all.head_dim * 2;
  return slice;
}

// With `packed`, an item names its sequence and layer only.
absl::Status CheckBareItems(const v1::DecodeStepRequest& request) {
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::DecodeItem& in = request.items(i);
    if (in.has_q() || in.has_k() || in.has_v() || in.has_out_shm() || in.has_lse_shm()) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", i,
                       ": with `packed`, items carry only sequence_id and layer (their tensors and "
                       "output places are in `packed`)"));
    }
  }
  return absl::OkStatus();
}

struct PackedRows {
  kvcache::HostRows q, k, v;
  std::vector<int64_t> rows_q, rows_kv;
};

absl::StatusOr<PackedRows> ResolvePacked(const v1::DecodeStepRequest& request, SequenceShm* shm) {
  const v1::PackedDecodeRows& packed = request.packed();
  const int items = request.items_size();
  PackedRows r;
  absl::StatusOr<kvcache::HostRows> rows = DecodeTensorRows(packed.q(), "packed.q", false, shm);
  if (!rows.ok()) return rows.status();
  r.q = *rows;
  if (rows = DecodeTensorRows(packed.k(), "packed.k", true, shm); !rows.ok()) return rows.status();
  r.k = *rows;
  if (rows = DecodeTensorRows(packed.v(), "packed.v", true, shm); !rows.ok()) return rows.status();
  r.v = *rows;
  absl::StatusOr<std::vector<int64_t>> q_counts =
      RowCounts(packed.rows_q(), "rows_q", items, 1, kvcache::kMaxQueryRows,
                std::vector<int64_t>(size_t(items), 1));
  if (!q_counts.ok()) return q_counts.status();
  r.rows_q = *std::move(q_counts);
  const bool has_kv = r.k.data != nullptr || r.v.data != nullptr;
  if (has_kv && (r.k.data == nullptr || r.v.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("packed.", r.k.data == nullptr ? "k" : "v",
                                                   " is missing: new rows need both k and v"));
  }
  absl::StatusOr<std::vector<int64_t>> kv_counts =
      RowCounts(packed.rows_kv(), "rows_kv", items, 0, r.k.rows,
                has_kv ? r.rows_q : std::vector<int64_t>(size_t(items), 0));
  if (!kv_counts.ok()) return kv_counts.status();
  r.rows_kv = *std::move(kv_counts);
  if (absl::Status s = CheckTotal(r.rows_q, r.q, "q"); !s.ok()) return s;
  if (absl::Status s = CheckTotal(r.rows_kv, r.k, "k"); !s.ok()) return s;
  if (absl::Status s = CheckTotal(r.rows_kv, r.v, "v"); !s.ok()) return s;
  return r;
}

// With packed.answer_packed, the place of the whole step's O (or LSE) in the answer: one tensor
// of response.packed, from `answer` while it has room, else in the message.
ShmPlace PackedAnswerPlace(v1::Tensor* tensor, v1::DType dtype, std::vector<int64_t> shape,
                           int64_t element_bytes, bool lse, AnswerBuffer* answer) {
  int64_t bytes = element_bytes;
  for (int64_t d : shape) bytes *= d;
  ShmPlace place;
  if (answer != nullptr) {
    place.data =
        lse ? answer->TakeLse(size_t(bytes), tensor) : answer->TakeOut(size_t(bytes), tensor);
    place.at = answer->at();
  }
  if (place.data == nullptr) {
    std::string* in_message = tensor->mutable_data();
    in_message->resize(size_t(bytes));
    place = {in_message->data(), kvcache::BytesAt::kHost};
  }
  tensor->set_dtype(dtype);
  for (int64_t d : shape) tensor->add_shape(d);
  return place;
}

}  // namespace

absl::StatusOr<std::vector<kvcache::StepItem>> PackedItems(const v1::DecodeStepRequest& request,
                                                           SequenceShm* shm) {
  if (absl::Status s = CheckBareItems(request); !s.ok()) return s;
  absl::StatusOr<PackedRows> packed = ResolvePacked(request, shm);
  if (!packed.ok()) return packed.status();
  std::vector<kvcache::StepItem> items(size_t(request.items_size()));
  int64_t first_q = 0, first_kv = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    kvcache::StepItem& item = items[i];
    item.id = request.items(int(i)).sequence_id();
    item.layer = request.items(int(i)).layer();
    item.q = Slice(packed->q, first_q, packed->rows_q[i]);
    if (packed->rows_kv[i] > 0) {  // else k/v stay unset, as an item without k/v
      item.k = Slice(packed->k, first_kv, packed->rows_kv[i]);
      item.v = Slice(packed->v, first_kv, packed->rows_kv[i]);
    }
    first_q += packed->rows_q[i];
    first_kv += packed->rows_kv[i];
  }
  return items;
}

absl::Status AddPackedOutputs(const v1::DecodeStepRequest& request, SequenceShm* shm,
                              DecodeCall* call, v1::DecodeStepResponse* response,
                              AnswerBuffer* answer) {
  const v1::PackedDecodeRows& packed = request.packed();
  const bool lse_wanted = request.return_lse();
  const bool out_in_shm = packed.has_out_shm(), lse_in_shm = lse_wanted && packed.has_lse_shm();
  if ((out_in_shm || lse_in_shm) && shm == nullptr) {
    return absl::InvalidArgumentError(
        "packed out_shm / lse_shm given where shared memory is "
        "unsupported");
  }
  int64_t out_bytes = 0, lse_bytes = 0;
  for (const kvcache::StepItem& item : call->items) {
    out_bytes += OutBytes(item.q);
    lse_bytes += LseBytes(item.q);
  }
  ShmPlace out_place, lse_place;
  if (out_in_shm) {
    absl::StatusOr<ShmPlace> at = ShmOutput(packed.out_shm(), "packed.out_shm", out_bytes, 1, shm);
    if (!at.ok()) return at.status();
    out_place = *at;
  }
  if (lse_in_shm) {
    absl::StatusOr<ShmPlace> at = ShmOutput(packed.lse_shm(), "packed.lse_shm", lse_bytes, 4, shm);
    if (!at.ok()) return at.status();
    lse_place = *at;
  }
  const bool out_packed = packed.answer_packed() && !out_in_shm;
  const bool lse_packed = packed.answer_packed() && lse_wanted && !lse_in_shm;
  const kvcache::StepItem& first = call->items.front();  // all slices of one packed q
  if (out_packed) {
    out_place = PackedAnswerPlace(
        response->mutable_packed()->mutable_out(), static_cast<v1::DType>(first.q.dtype),
        {out_bytes / (first.q.heads * first.q.head_dim * 2), first.q.heads, first.q.head_dim}, 2,
        /*lse=*/false, answer);
  }
  if (lse_packed) {
    lse_place = PackedAnswerPlace(response->mutable_packed()->mutable_lse(), v1::FLOAT32,
                                  {lse_bytes / 4}, 4, /*lse=*/true, answer);
  }
  const bool out_given = out_in_shm || out_packed, lse_given = lse_in_shm || lse_packed;
  response->mutable_results()->Reserve(request.items_size());
  int64_t out_at = 0, lse_at = 0;
  for (const kvcache::StepItem& item : call->items) {
    const ItemOutputPlaces places{out_given ? out_place.data + out_at : nullptr, out_place.at,
                                  lse_given ? lse_place.data + lse_at : nullptr, lse_place.at};
    v1::DecodeResult* result = response->add_results();
    AddItemOutputsAt(item, lse_wanted, places, out_packed ? nullptr : result->mutable_out(),
                     lse_wanted && !lse_packed ? result->mutable_lse() : nullptr, call, answer);
    out_at += OutBytes(item.q);
    lse_at += LseBytes(item.q);
  }
  return shm == nullptr ? absl::OkStatus() : CheckShmOverlap(*shm);
}

}  // namespace flashserve
