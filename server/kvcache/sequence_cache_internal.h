// The record of one sequence and the checks shared by the SequenceCache's files. Internal.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcache/sequence_cache.h"

namespace flashserve::kvcache {

/// NOT_FOUND for `ids` (unknown or evicted): the message names each (sequence_id.h's
/// ShownSequenceId), the payload lists the well-formed ones (MissingSequenceIdList).
absl::Status UnknownSequences(const std::vector<std::string_view>& ids);

struct SequenceCache::Sequence {
  std::string id;
  std::string label;
  SequenceShape shape;
  PageFormat format;
  int64_t max_tokens = 0;
  std::vector<int64_t> lengths;  // per layer: tokens written
  // Per layer: its pages in token order, as numbers (offset / format.page_bytes): what a launch's
  // page table holds, so a step copies them as they are.
  std::vector<std::vector<int32_t>> page_ids;
  absl::Time last_used;
  int pins = 0;        // running steps that read it
  bool ready = false;  // false while its prefix is written (invisible to lookups)
  // Out of the table (released, evicted, or its create failed): a pinned one waits in retired_
  // for its last unpin, and an Append that was copying into it meanwhile must not answer OK.
  bool released = false;
  // An Append is copying rows into pages past `lengths` outside the lock: other appends and steps
  // on this sequence wait for it (SequenceCache::appended_).
  bool appending = false;
  // Its create's token (empty: none) and prefix rows per layer: a create naming the token is
  // answered with this sequence if it asks for the same settings.
  std::string create_token;
  std::vector<int64_t> prefix_rows;

  int64_t page_count() const {
    int64_t n = 0;
    for (const auto& layer : page_ids) n += int64_t(layer.size());
    return n;
  }
};

/// INVALID_ARGUMENT unless k and v are rows of `shape`'s K/V (dtype, heads_kv, head_dim, equal
/// rows).
absl::Status CheckKvRows(const SequenceShape& shape, const HostRows& k, const HostRows& v);
/// INVALID_ARGUMENT unless q is 1..kMaxQueryRows rows of `shape`'s queries.
absl::Status CheckQueryRows(const SequenceShape& shape, const HostRows& q);
/// Whether `rows` sent for a layer of `length` tokens with `expected` (the client's count of the
/// layer before them; < 0: unchecked) are already there from an earlier try of the call (true)
/// or are to be appended (false). ABORTED ("layer L holds ...") when the length is neither.
absl::StatusOr<bool> RowsAlreadyThere(int layer, int64_t length, int64_t expected, int64_t rows);
/// DEADLINE_EXCEEDED once `now` reached `deadline`, saying the call's deadline passed `while_what`
/// (its client has stopped waiting and must not find the call's rows, or a sequence, applied
/// later).
absl::Status CheckDeadline(absl::Time now, absl::Time deadline, const char* while_what);
// CANCELLED when `cancelled` (may be empty) says so, else CheckDeadline.
absl::Status CheckStillWanted(absl::Time now, absl::Time deadline,
                              const std::function<bool()>& cancelled, const char* while_what);
// Why a wait gave up (never OK): CANCELLED when `cancelled` says so, else DEADLINE_EXCEEDED.
absl::Status GaveUpWaiting(const std::function<bool()>& cancelled, const char* while_what);
/// DEADLINE_EXCEEDED for a call whose wait for another append to its sequence gave up.
absl::Status StillAppending();
/// INVALID_ARGUMENT unless `token` is empty or 16..64 characters of [0-9A-Za-z_-]. The message
/// gives its length, never the token (client data, and whoever has it can obtain the sequence).
absl::Status CheckCreateToken(std::string_view token);
/// Per layer of a validated create: the rows its prefix gives (0 for a layer without).
std::vector<int64_t> PrefixRowsOf(const CreateRequest& request);
/// INVALID_ARGUMENT unless a and b have the same heads, head_dim and dtype.
absl::Status CheckSameShape(const SequenceShape& a, const SequenceShape& b);

}  // namespace flashserve::kvcache
