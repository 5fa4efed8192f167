// DecodeStep with packed tensors (edge/sequences/sequences_packed.h): the items get exactly the
// slices an unpacked step of the same rows would carry, and every inconsistency between the
// items, the counts and the packed tensors is refused before any output is sized.
#include "edge/sequences/sequences_packed.h"

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_shm.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr int64_t kHeadsQ = 4, kHeadsKv = 2, kDim = 8;

v1::Tensor Rows(int64_t rows, int64_t heads, std::mt19937* rng) {
  v1::Tensor t;
  t.set_dtype(v1::BFLOAT16);
  for (int64_t d : {rows, heads, kDim}) t.add_shape(d);
  std::string bytes(size_t(rows * heads * kDim * 2), '\0');
  for (char& c : bytes) c = char((*rng)() & 0xff);
  t.set_data(bytes);
  return t;
}

// A packed step of items with these query / key rows, and the same step unpacked: item i's
// tensors are its rows of the packed ones.
struct TwoForms {
  v1::DecodeStepRequest packed, unpacked;
};
TwoForms MakeSteps(const std::vector<int>& rows_q, const std::vector<int>& rows_kv, uint32_t seed) {
  std::mt19937 rng(seed);
  int64_t total_q = 0, total_kv = 0;
  for (int n : rows_q) total_q += n;
  for (int n : rows_kv) total_kv += n;
  TwoForms f;
  v1::PackedDecodeRows* p = f.packed.mutable_packed();
  *p->mutable_q() = Rows(total_q, kHeadsQ, &rng);
  *p->mutable_k() = Rows(total_kv, kHeadsKv, &rng);
  *p->mutable_v() = Rows(total_kv, kHeadsKv, &rng);
  int64_t q0 = 0, kv0 = 0;
  for (size_t i = 0; i < rows_q.size(); ++i) {
    p->add_rows_q(rows_q[i]);
    p->add_rows_kv(rows_kv[i]);
    const std::string id = "s" + std::to_string(i);
    v1::DecodeItem* bare = f.packed.add_items();
    bare->set_sequence_id(id);
    bare->set_layer(int(i) % 3);
    v1::DecodeItem* full = f.unpacked.add_items();
    *full = *bare;
    auto slice = [](const v1::Tensor& all, int64_t first, int64_t rows, int64_t heads) {
      v1::Tensor t = all;
      t.set_shape(0, rows);
      const size_t row_bytes = size_t(heads * kDim * 2);
      t.set_data(all.data().substr(size_t(first) * row_bytes, size_t(rows) * row_bytes));
      return t;
    };
    *full->mutable_q() = slice(p->q(), q0, rows_q[i], kHeadsQ);
    if (rows_kv[i] > 0) {
      *full->mutable_k() = slice(p->k(), kv0, rows_kv[i], kHeadsKv);
      *full->mutable_v() = slice(p->v(), kv0, rows_kv[i], kHeadsKv);
    }
    q0 += rows_q[i];
    kv0 += rows_kv[i];
  }
  f.packed.set_return_lse(true);
  f.unpacked.set_return_lse(true);
  return f;
}

std::string Bytes(const kvcache::HostRows& r) {
  if (r.rows == 0) return "";
  return std::string(static_cast<const char*>(r.data), size_t(r.rows * r.heads * r.head_dim * 2));
}

TEST(SequencesPacked, ItemsAreTheSlicesAnUnpackedStepCarries) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const TwoForms f = MakeSteps({1, 3, 16, 1, 2}, {1, 0, 5, 1, 2}, seed);
  SequenceShm shm;
  v1::DecodeStepResponse packed_response, unpacked_response;
  auto packed = BuildDecodeStep(f.packed, 8, &shm, &packed_response);
  auto unpacked = BuildDecodeStep(f.unpacked, 8, &shm, &unpacked_response);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ASSERT_TRUE(unpacked.ok()) << unpacked.status();
  ASSERT_EQ((*packed)->items.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const kvcache::StepItem& a = (*packed)->items[i];
    const kvcache::StepItem& b = (*unpacked)->items[i];
    EXPECT_EQ(a.id, b.id);
    EXPECT_EQ(a.layer, b.layer);
    for (auto [x, y] : {std::pair{&a.q, &b.q}, std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v}}) {
      EXPECT_EQ(x->rows, y->rows) << i;
      EXPECT_EQ(Bytes(*x), Bytes(*y)) << i;
      if (x->rows > 0) {
        EXPECT_EQ(x->heads, y->heads) << i;
      }
    }
  }
  // Outputs sized alike: one result per item, O like its q, LSE [heads_q, rows_q].
  ASSERT_EQ(packed_response.results_size(), 5);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(packed_response.results(i).out().data().size(),
              unpacked_response.results(i).out().data().size());
    EXPECT_EQ(packed_response.results(i).lse().data().size(),
              unpacked_response.results(i).lse().data().size());
  }
  EXPECT_EQ((*packed)->out.size(), 5u);
  EXPECT_EQ((*packed)->lse.size(), 5u);
}

TEST(SequencesPacked, CountsDefaultToOneRowEach) {
  TwoForms f = MakeSteps({1, 1, 1}, {1, 1, 1}, 7);
  f.packed.mutable_packed()->clear_rows_q();
  f.packed.mutable_packed()->clear_rows_kv();
  SequenceShm shm;
  v1::DecodeStepResponse response;
  auto call = BuildDecodeStep(f.packed, 8, &shm, &response);
  ASSERT_TRUE(call.ok()) << call.status();
  for (const kvcache::StepItem& item : (*call)->items) {
    EXPECT_EQ(item.q.rows, 1);
    EXPECT_EQ(item.k.rows, 1);
  }
  // Without k and v: attend only, no rows appended.
  f.packed.mutable_packed()->clear_k();
  f.packed.mutable_packed()->clear_v();
  call = BuildDecodeStep(f.packed, 8, &shm, &response);
  ASSERT_TRUE(call.ok()) << call.status();
  for (const kvcache::StepItem& item : (*call)->items) EXPECT_EQ(item.k.rows, 0);
}

// Each mutation of a valid packed step is refused with INVALID_ARGUMENT naming the field, and no
// output is sized for it.
TEST(SequencesPacked, InconsistenciesAreRefused) {
  struct Bad {
    const char* what;
    std::function<void(v1::DecodeStepRequest*)> mutate;
  };
  const std::vector<Bad> bad = {
      {"items carry only", [](auto* r) { *r->mutable_items(1)->mutable_q() = r->packed().q(); }},
      {"items carry only",
       [](auto* r) { r->mutable_items(0)->mutable_out_shm()->set_region("x"); }},
      {"rows_q has 2 entries",
       [](auto* r) { r->mutable_packed()->mutable_rows_q()->RemoveLast(); }},
      {"rows_kv has 2 entries",
       [](auto* r) { r->mutable_packed()->mutable_rows_kv()->RemoveLast(); }},
      {"rows_q[0] must be in 1..16", [](auto* r) { r->mutable_packed()->set_rows_q(0, 0); }},
      {"rows_q[2] must be in 1..16", [](auto* r) { r->mutable_packed()->set_rows_q(2, 17); }},
      {"rows_kv[1] must be in", [](auto* r) { r->mutable_packed()->set_rows_kv(1, -1); }},
      {"packed.q has 4 rows, the items' counts add up to 5",
       [](auto* r) { r->mutable_packed()->set_rows_q(0, 2); }},
      {"packed.k has 3 rows", [](auto* r) { r->mutable_packed()->set_rows_kv(0, 0); }},
      {"packed.v is missing", [](auto* r) { r->mutable_packed()->clear_v(); }},
      {"packed.k is missing", [](auto* r) { r->mutable_packed()->clear_k(); }},
      {"packed.q:", [](auto* r) { r->mutable_packed()->mutable_q()->mutable_data()->pop_back(); }},
  };
  for (const Bad& b : bad) {
    TwoForms f = MakeSteps({1, 2, 1}, {1, 1, 1}, 11);
    b.mutate(&f.packed);
    SequenceShm shm;
    v1::DecodeStepResponse response;
    const absl::Status s = BuildDecodeStep(f.packed, 8, &shm, &response).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.what << ": " << s;
    EXPECT_NE(s.message().find(b.what), std::string::npos) << b.what << ": " << s;
    EXPECT_EQ(response.results_size(), 0) << b.what;
  }
}

TEST(SequencesPacked, OutputsInARegionNeedSharedMemory) {
  TwoForms f = MakeSteps({1, 1}, {1, 1}, 3);
  f.packed.mutable_packed()->mutable_out_shm()->set_region("out");
  f.packed.mutable_packed()->mutable_out_shm()->set_byte_size(2 * kHeadsQ * kDim * 2);
  v1::DecodeStepResponse response;
  EXPECT_EQ(BuildDecodeStep(f.packed, 8, /*shm=*/nullptr, &response).status().code(),
            absl::StatusCode::kInvalidArgument);
  SequenceShm off;  // a server without --allow_client_shm
  EXPECT_EQ(BuildDecodeStep(f.packed, 8, &off, &response).status().code(),
            absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace flashserve
