// Shape and dtype checks of the rows a client sends against its sequence, and of a create's
// token against the sequence it names.
#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvcache/sequence_cache_internal.h"

namespace flashserve::kvcache {

namespace {

absl::Status CheckRows(const SequenceShape& shape, const HostRows& rows, const char* what,
                       int64_t heads, const char* heads_name) {
  if (rows.dtype != shape.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is ", std::string(kernels::dtype_name(rows.dtype)), " but the sequence is ",
        std::string(kernels::dtype_name(shape.dtype)), " (a sequence's dtype cannot change)"));
  }
  if (rows.heads != heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", rows.heads, " heads but the sequence has ", heads_name, "=", heads));
  }
  if (rows.head_dim != shape.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has head_dim ", rows.head_dim,
                                                   " but the sequence has ", shape.head_dim));
  }
  if (rows.rows < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative rows"));
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKvRows(const SequenceShape& shape, const HostRows& k, const HostRows& v) {
  if (k.rows == 0 && v.rows == 0) return absl::OkStatus();
  if (absl::Status s = CheckRows(shape, k, "k", shape.heads_kv, "heads_kv"); !s.ok()) return s;
  if (absl::Status s = CheckRows(shape, v, "v", shape.heads_kv, "heads_kv"); !s.ok()) return s;
  if (k.rows != v.rows) {
    return absl::InvalidArgumentError(absl::StrCat("k has ", k.rows, " rows but v has ", v.rows));
  }
  return absl::OkStatus();
}

absl::Status CheckQueryRows(const SequenceShape& shape, const HostRows& q) {
  if (absl::Status s = CheckRows(shape, q, "q", shape.heads_q, "heads_q"); !s.ok()) return s;
  if (q.rows < 1 || q.rows > kMaxQueryRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has ", q.rows, " rows; 1..", kMaxQueryRows, " are allowed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> RowsAlreadyThere(int layer, int64_t length, int64_t expected, int64_t rows) {
  if (expected < 0 || length == expected) return false;
  // Lengths, not bytes, are compared: the client asserts it is the layer's only writer.
  if (rows > 0 && length - rows == expected) return true;
  return absl::AbortedError(absl::StrCat(
      "layer ", layer, " holds ", length, " tokens but the call expected ", expected,
      " before its ", rows,
      " row(s): another writer appended, or the client's count is off; nothing was appended "
      "(GetSequenceInfo has the lengths)"));
}

absl::Status CheckDeadline(absl::Time now, absl::Time deadline, const char* while_what) {
  if (now < deadline) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat("the call's deadline passed ", while_what, "; nothing of it was kept"));
}

absl::Status CheckStillWanted(absl::Time now, absl::Time deadline,
                              const std::function<bool()>& cancelled, const char* while_what) {
  if (cancelled && cancelled()) {
    return absl::CancelledError(
        absl::StrCat("the call was cancelled ", while_what, "; nothing of it was kept"));
  }
  return CheckDeadline(now, deadline, while_what);
}

absl::Status GaveUpWaiting(const std::function<bool()>& cancelled, const char* while_what) {
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat("the call was cancelled ", while_what));
  }
  return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed ", while_what));
}

absl::Status StillAppending() {
  return absl::DeadlineExceededError(
      "the call's deadline passed while it waited for another append to its sequence; nothing of "
      "it was kept");
}

absl::Status CheckCreateToken(std::string_view token) {
  constexpr size_t kMinTokenChars = 16, kMaxTokenChars = 64;
  const auto allowed = [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
           c == '-';
  };
  if (token.empty()) return absl::OkStatus();
  if (token.size() >= kMinTokenChars && token.size() <= kMaxTokenChars &&
      std::all_of(token.begin(), token.end(), allowed)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("create_token must be ", kMinTokenChars, " to ", kMaxTokenChars,
                   " characters of [0-9A-Za-z_-] (random: at least 128 bits); got a malformed "
                   "token (",
                   token.size(), " bytes)"));
}

std::vector<int64_t> PrefixRowsOf(const CreateRequest& request) {
  std::vector<int64_t> rows(size_t(request.shape.num_layers), 0);
  for (const LayerRows& r : request.prefix) rows[size_t(r.layer)] = r.k.rows;
  return rows;
}

absl::Status SequenceCache::CheckSameCreate(const Sequence& seq,
                                            const CreateRequest& request) const {
  // Settings, and the prefix's row counts, not its bytes (as expected_length compares lengths):
  // the client asserts that it sends a token with one request only.
  const auto differs = [](const std::string& what, const std::string& made,
                          const std::string& asked) {
    return absl::AlreadyExistsError(absl::StrCat(
        "create_token names a sequence created with ", what, " = ", made, ", this request has ",
        asked, ": a token is for retrying one create (use a new token for a new sequence)"));
  };
  const SequenceShape& made = seq.shape;
  const SequenceShape& asked = request.shape;
  const std::pair<const char*, std::pair<int64_t, int64_t>> numbers[] = {
      {"num_layers", {made.num_layers, asked.num_layers}},
      {"heads_q", {made.heads_q, asked.heads_q}},
      {"heads_kv", {made.heads_kv, asked.heads_kv}},
      {"head_dim", {made.head_dim, asked.head_dim}},
      {"max_tokens", {seq.max_tokens, MaxTokensOf(request)}}};
  for (const auto& [what, values] : numbers) {
    if (values.first != values.second)
      return differs(what, absl::StrCat(values.first), absl::StrCat(values.second));
  }
  if (made.dtype != asked.dtype) {
    return differs("dtype", std::string(kernels::dtype_name(made.dtype)),
                   std::string(kernels::dtype_name(asked.dtype)));
  }
  const std::vector<int64_t> rows = PrefixRowsOf(request);
  for (size_t layer = 0; layer < rows.size(); ++layer) {
    if (rows[layer] != seq.prefix_rows[layer]) {
      return differs(absl::StrCat("prefix rows of layer ", layer),
                     absl::StrCat(seq.prefix_rows[layer]), absl::StrCat(rows[layer]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSameShape(const SequenceShape& a, const SequenceShape& b) {
  if (a.heads_q != b.heads_q || a.heads_kv != b.heads_kv || a.head_dim != b.head_dim ||
      a.dtype != b.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sequences of one DecodeStep must share heads_q, heads_kv, head_dim and dtype: ",
        a.heads_q, ":", a.heads_kv, ":", a.head_dim, ":", std::string(kernels::dtype_name(a.dtype)),
        " vs ", b.heads_q, ":", b.heads_kv, ":", b.head_dim, ":",
        std::string(kernels::dtype_name(b.dtype))));
  }
  return absl::OkStatus();
}

}  // namespace flashserve::kvcache
