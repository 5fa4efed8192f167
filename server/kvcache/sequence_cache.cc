#include "kvcache/sequence_cache.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "kvcache/sequence_cache_internal.h"
#include "kvcache/sequence_id.h"

namespace flashserve::kvcache {

absl::Status KvCacheOptions::Check() const {
  if (capacity_bytes < 0) return absl::InvalidArgumentError("--kv_cache_bytes must be >= 0");
  if (capacity_bytes > 0 && capacity_bytes < PageAllocator::kSlabBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_bytes must be 0 (off) or at least ",
                                                   PageAllocator::kSlabBytes, " (one slab)"));
  }
  if (page_tokens < 1 || page_tokens > 1024) {
    return absl::InvalidArgumentError("--kv_page_tokens must be in [1, 1024]");
  }
  if (ttl < absl::ZeroDuration())
    return absl::InvalidArgumentError("--sequence_ttl_s must be >= 0");
  if (max_sequences < 1) return absl::InvalidArgumentError("--max_sequences must be >= 1");
  if (max_sequence_tokens < 1 || max_sequence_tokens > (int64_t(1) << 30)) {
    return absl::InvalidArgumentError("--max_sequence_tokens must be in [1, 2^30]");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SequenceCache>> SequenceCache::Create(const KvCacheOptions& options,
                                                                     KvStore* store,
                                                                     KvCacheMetrics* metrics) {
  if (absl::Status s = options.Check(); !s.ok()) return s;
  if (store == nullptr || store->capacity_bytes() < options.capacity_bytes) {
    return absl::InternalError("KV store smaller than --kv_cache_bytes");
  }
  return std::unique_ptr<SequenceCache>(new SequenceCache(options, store, metrics));
}

SequenceCache::SequenceCache(const KvCacheOptions& options, KvStore* store, KvCacheMetrics* metrics)
    : options_(options), store_(store), metrics_(metrics), pages_(options.capacity_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  last_sweep_ = Now();
  PublishLocked();
}

SequenceCache::~SequenceCache() = default;

absl::Status SequenceCache::ValidateCreate(const CreateRequest& request) const {
  const SequenceShape& shape = request.shape;
  if (shape.num_layers < 1 || shape.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be in [1, ", kMaxLayers, "]"));
  }
  if (shape.heads_kv < 1 || shape.heads_q < 1 || shape.heads_q > kMaxHeads ||
      shape.heads_q % shape.heads_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heads_q (", shape.heads_q, ") must be a multiple of heads_kv (",
                     shape.heads_kv, "), both in [1, ", kMaxHeads, "]"));
  }
  if (shape.dtype != kernels::DType::kFloat16 && shape.dtype != kernels::DType::kBFloat16) {
    return absl::InvalidArgumentError("dtype must be FLOAT16 or BFLOAT16");
  }
  const std::vector<int> dims = store_->head_dims();
  const bool dim_ok = dims.empty() ? shape.head_dim >= 1 && shape.head_dim <= kMaxHeadDim
                                   : std::count(dims.begin(), dims.end(), shape.head_dim) > 0;
  if (!dim_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", shape.head_dim, " is not supported by the ",
                     std::string(store_->kind()), " backend's KV cache"));
  }
  if (request.max_tokens < 0 || request.max_tokens > options_.max_sequence_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens must be in [0, ", options_.max_sequence_tokens, "] (--max_sequence_tokens)"));
  }
  const PageFormat format = FormatFor(shape, options_.page_tokens);
  if (!PageAllocator::ValidPageBytes(format.page_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a page of ", options_.page_tokens, " tokens of this shape needs ", format.page_bytes,
        " bytes, more than ", PageAllocator::kSlabBytes, " (lower --kv_page_tokens)"));
  }
  // Page numbers are 32-bit (the launches' page tables): a pool that holds more pages of this
  // size than that could hand out a page whose number wraps (a silent wrong answer).
  if (options_.capacity_bytes / format.page_bytes > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pages of this shape are ", format.page_bytes,
                     " bytes: --kv_cache_bytes=", options_.capacity_bytes,
                     " would hold more than 2^31 - 1 of them, which page tables cannot "
                     "number (raise --kv_page_tokens or lower --kv_cache_bytes)"));
  }
  if (absl::Status s = CheckCreateToken(request.create_token); !s.ok()) return s;
  const int64_t limit = MaxTokensOf(request);
  std::vector<bool> seen(size_t(shape.num_layers), false);
  for (const LayerRows& rows : request.prefix) {
    if (rows.layer < 0 || rows.layer >= shape.num_layers || seen[size_t(rows.layer)]) {
      return absl::InvalidArgumentError(absl::StrCat("prefix layer ", rows.layer,
                                                     " is out of range or given twice (num_layers ",
                                                     shape.num_layers, ")"));
    }
    seen[size_t(rows.layer)] = true;
    if (absl::Status s = CheckKvRows(shape, rows.k, rows.v); !s.ok()) return s;
    if (rows.k.rows > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix of ", rows.k.rows, " tokens exceeds the limit of ", limit));
    }
  }
  return absl::OkStatus();
}

int64_t SequenceCache::MaxTokensOf(const CreateRequest& request) const {
  return request.max_tokens > 0 ? request.max_tokens : options_.max_sequence_tokens;
}

absl::StatusOr<SequenceStatus> SequenceCache::CreateSequence(
    const CreateRequest& request, absl::Time deadline, const std::function<bool()>& cancelled) {
  if (absl::Status s = ValidateCreate(request); !s.ok()) return s;
  absl::StatusOr<std::string> id = NewSequenceId();
  if (!id.ok()) return id.status();
  std::unique_ptr<Sequence> seq = NewSequence(request, *std::move(id));
  std::vector<PageRun> runs;
  for (const LayerRows& rows : request.prefix)
    runs.push_back(RunToGrow(*seq, rows.layer, rows.k.rows));
  std::vector<int64_t> fresh;
  Sequence* raw = seq.get();
  {
    std::unique_lock<std::mutex> lock(mu_);
    MaybeEvictLocked();
    // Looked up and admitted under one hold of mu_: two creates with one token make one sequence.
    absl::StatusOr<Sequence*> earlier = FindCreatedLocked(request, &lock, deadline, cancelled);
    if (!earlier.ok()) return earlier.status();
    if (*earlier != nullptr) return AnswerCreatedLocked(*earlier);
    if (absl::Status s = AdmitLocked(std::move(seq), runs, &fresh); !s.ok()) return s;
  }
  return FinishCreate(raw, WritePrefix(raw, request.prefix, &fresh), deadline, cancelled, &fresh);
}

std::unique_ptr<SequenceCache::Sequence> SequenceCache::NewSequence(const CreateRequest& request,
                                                                    std::string id) const {
  auto seq = std::make_unique<Sequence>();
  seq->id = std::move(id);
  // Cut on a character boundary: SequenceInfo returns it in a proto3 string.
  seq->label = std::string(Utf8Prefix(request.label, 128));
  seq->shape = request.shape;
  seq->format = FormatFor(request.shape, options_.page_tokens);
  seq->max_tokens = MaxTokensOf(request);
  seq->lengths.assign(size_t(request.shape.num_layers), 0);
  seq->page_ids.resize(size_t(request.shape.num_layers));
  seq->create_token = request.create_token;
  seq->prefix_rows = PrefixRowsOf(request);
  return seq;
}

absl::StatusOr<SequenceCache::Sequence*> SequenceCache::FindCreatedLocked(
    const CreateRequest& request, std::unique_lock<std::mutex>* lock, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  if (request.create_token.empty()) return nullptr;
  while (true) {
    auto it = tokens_.find(request.create_token);
    if (it == tokens_.end()) return nullptr;
    Sequence* seq = it->second;
    if (seq->ready) {
      if (absl::Status s = CheckSameCreate(*seq, request); !s.ok()) return s;
      return seq;
    }
    // Its create is writing the prefix (an earlier try of this one, whose client stopped
    // waiting): answer it once it is ready, or create anew if it fails.
    ++token_waiters_[request.create_token];
    const bool in_time = WaitLocked(&settled_, lock, deadline, cancelled);
    if (--token_waiters_[request.create_token] == 0) token_waiters_.erase(request.create_token);
    if (!in_time) {
      return GaveUpWaiting(cancelled,
                           "while it waited for another create with the same create_token to "
                           "write its prefix; nothing was created (retry with the same token)");
    }
  }
}

SequenceStatus SequenceCache::AnswerCreatedLocked(Sequence* seq) {
  seq->last_used = Now();
  if (metrics_ != nullptr) metrics_->RecordAlreadyCreated();
  SequenceStatus status = StatusOf(*seq);
  status.already_created = true;
  return status;
}

absl::Status SequenceCache::AdmitLocked(std::unique_ptr<Sequence> seq,
                                        const std::vector<PageRun>& runs,
                                        std::vector<int64_t>* fresh) {
  if (int64_t(table_.size()) >= options_.max_sequences) EvictIdleLocked();
  if (int64_t(table_.size()) >= options_.max_sequences) {
    if (metrics_ != nullptr) metrics_->RecordRefused("max_sequences");
    return absl::ResourceExhaustedError(absl::StrCat("too many sequences: ", table_.size(),
                                                     " live (--max_sequences); release some"));
  }
  if (absl::Status s = TakePages(seq->format.page_bytes, runs, {}, fresh); !s.ok()) return s;
  seq->pins = 1;  // hidden (not ready) and pinned while its prefix is written
  seq->last_used = Now();
  if (!seq->create_token.empty()) tokens_.emplace(seq->create_token, seq.get());
  Sequence* raw = seq.get();
  table_.emplace(raw->id, std::move(seq));
  PublishLocked();
  return absl::OkStatus();
}

absl::Status SequenceCache::WritePrefix(Sequence* seq, const std::vector<LayerRows>& prefix,
                                        std::vector<int64_t>* fresh) {
  for (const LayerRows& rows : prefix) {
    if (absl::Status s = WriteRows(seq, rows.layer, rows.k, rows.v, fresh); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceStatus> SequenceCache::FinishCreate(Sequence* seq, absl::Status written,
                                                           absl::Time deadline,
                                                           const std::function<bool()>& cancelled,
                                                           std::vector<int64_t>* fresh) {
  std::lock_guard<std::mutex> lock(mu_);
  settled_.notify_all();  // the creates waiting for its token look again once mu_ is free
  seq->pins = 0;
  // A client that stopped waiting (its deadline passed, or it cancelled or disconnected) would
  // leave the sequence unnamed until its TTL (a re-prefill storm under tight deadlines piled them
  // up): not kept -- unless a retry with its token waits for it (the retry names it; dropped,
  // the retry would write the prefix all over again).
  if (written.ok() && token_waiters_.count(seq->create_token) == 0) {
    written = CheckDeadline(Now(), deadline, "while its prefix was written");
    if (written.ok() && cancelled && cancelled()) {
      written = absl::CancelledError("the call was cancelled while its prefix was written");
    }
  }
  if (!written.ok()) {
    pages_.Free(seq->format.page_bytes, *fresh);  // taken for layers not reached
    Remove(seq);                                  // with its token: a retry creates anew
    PublishLocked();
    return written;
  }
  seq->ready = true;
  seq->last_used = Now();
  if (metrics_ != nullptr) metrics_->RecordCreated();
  return StatusOf(*seq);
}

int64_t SequenceCache::PagesToGrow(const Sequence& seq, int layer, int64_t new_length) const {
  const int64_t tokens = seq.format.page_tokens;
  const int64_t needed = (new_length + tokens - 1) / tokens;
  return std::max<int64_t>(0, needed - int64_t(seq.page_ids[size_t(layer)].size()));
}

SequenceCache::PageRun SequenceCache::RunToGrow(const Sequence& seq, int layer,
                                                int64_t new_length) const {
  const std::vector<int32_t>& ids = seq.page_ids[size_t(layer)];
  PageRun run;
  run.after = ids.empty() ? -1 : int64_t(ids.back()) * seq.format.page_bytes;
  run.count = PagesToGrow(seq, layer, new_length);
  return run;
}

absl::Status SequenceCache::TakePages(int64_t page_bytes, const std::vector<PageRun>& runs,
                                      const std::vector<Sequence*>& in_use,
                                      std::vector<int64_t>* fresh) {
  int64_t count = 0;
  for (const PageRun& run : runs) count += run.count;
  if (count == 0) return absl::OkStatus();
  if (pages_.Available(page_bytes) < count) {
    for (Sequence* seq : in_use) ++seq->pins;
    EvictIdleLocked();
    for (Sequence* seq : in_use) --seq->pins;
  }
  if (pages_.Available(page_bytes) >= count) {
    std::vector<int64_t> taken;
    for (const PageRun& run : runs) {
      if (run.count > 0) pages_.Allocate(page_bytes, run.count, &taken, run.after);
    }
    fresh->insert(fresh->end(), taken.rbegin(), taken.rend());
    return absl::OkStatus();
  }
  if (metrics_ != nullptr) metrics_->RecordRefused("pool_full");
  return absl::ResourceExhaustedError(
      absl::StrCat("KV cache full: ", count, " pages of ", page_bytes, " bytes needed, ",
                   pages_.Available(page_bytes), " free (", pages_.used_bytes(), " of ",
                   pages_.capacity_bytes(), " bytes in use, ", table_.size(),
                   " sequences; --kv_cache_bytes); release sequences or retry later"));
}

absl::Status SequenceCache::WriteRows(Sequence* seq, int layer, const HostRows& k,
                                      const HostRows& v, std::vector<int64_t>* fresh) {
  GrowTable(seq, layer, k.rows, fresh);
  int64_t& length = seq->lengths[size_t(layer)];
  if (absl::Status s = CopyRows(*seq, layer, length, k, v); !s.ok()) return s;
  length += k.rows;
  return absl::OkStatus();
}

void SequenceCache::GrowTable(Sequence* seq, int layer, int64_t rows, std::vector<int64_t>* fresh) {
  std::vector<int32_t>& ids = seq->page_ids[size_t(layer)];
  const int64_t end = seq->lengths[size_t(layer)] + rows;
  while (int64_t(ids.size()) * seq->format.page_tokens < end) {
    ids.push_back(int32_t(fresh->back() / seq->format.page_bytes));
    fresh->pop_back();
  }
}

absl::Status SequenceCache::CopyRows(const Sequence& seq, int layer, int64_t from,
                                     const HostRows& k, const HostRows& v) {
  const PageFormat& f = seq.format;
  const std::vector<int32_t>& ids = seq.page_ids[size_t(layer)];
  const char* k_src = static_cast<const char*>(k.data);
  const char* v_src = static_cast<const char*>(v.data);
  const int64_t end = from + k.rows;
  for (int64_t pos = from; pos < end;) {
    const int64_t in_page = pos % f.page_tokens;
    const int64_t n = std::min<int64_t>(f.page_tokens - in_page, end - pos);
    const int64_t at =
        int64_t(ids[size_t(pos / f.page_tokens)]) * f.page_bytes + in_page * f.row_bytes;
    const int64_t src = (pos - from) * f.row_bytes;
    absl::Status s = store_->Write(at, k_src + src, n * f.row_bytes, k.at);
    if (s.ok()) s = store_->Write(at + f.v_offset, v_src + src, n * f.row_bytes, v.at);
    if (!s.ok()) {
      store_->AwaitSources().IgnoreError();  // the caller frees the rows when this returns
      return s;
    }
    pos += n;
  }
  return store_->AwaitSources();  // once per call: not once per page
}

SequenceCache::Sequence* SequenceCache::FindLocked(std::string_view id) {
  // Only an id this server could have issued is copied and looked up (a client's 1 MiB "id" was
  // copied and hashed under the cache's lock).
  return WellFormedSequenceId(id) ? LookUpLocked(std::string(id)) : nullptr;
}

SequenceCache::Sequence* SequenceCache::FindLocked(const std::string& id) {
  return WellFormedSequenceId(id) ? LookUpLocked(id) : nullptr;  // never hashed (as above)
}

SequenceCache::Sequence* SequenceCache::LookUpLocked(const std::string& id) {
  auto it = table_.find(id);  // no copy of the id (a step looks up every item's)
  if (it == table_.end() || !it->second->ready) return nullptr;
  return it->second.get();
}

void SequenceCache::FreePages(Sequence* seq) {
  // Rows still deferred by the store must not land on the pages' next owner's rows.
  if (seq->page_count() > 0) store_->Fence();
  std::vector<int64_t> offsets;
  for (std::vector<int32_t>& layer : seq->page_ids) {
    offsets.clear();
    for (int32_t id : layer) offsets.push_back(int64_t(id) * seq->format.page_bytes);
    pages_.Free(seq->format.page_bytes, offsets);
    layer.clear();
  }
}

void SequenceCache::Remove(Sequence* seq) {
  // Tokens live only as long as their sequences: a later create with this one makes a new one.
  auto token = tokens_.find(seq->create_token);
  if (token != tokens_.end() && token->second == seq) tokens_.erase(token);
  auto it = table_.find(seq->id);
  std::unique_ptr<Sequence> owned = std::move(it->second);
  table_.erase(it);
  seq->released = true;
  if (seq->pins == 0) {
    FreePages(seq);
  } else {
    retired_.emplace(seq, std::move(owned));  // the last Unpin frees it
  }
}

void SequenceCache::Unpin(const std::vector<void*>& pinned) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time now = Now();
    for (void* p : pinned) {
      Sequence* seq = static_cast<Sequence*>(p);
      seq->last_used = now;  // idle counts from a step's end (a long launch is a use)
      UnpinLocked(seq);
    }
    PublishLocked();
  }
  unpinned_.notify_all();  // a Truncate waiting for the step to end
}

void SequenceCache::UnpinLocked(Sequence* seq) {
  if (--seq->pins > 0 || !seq->released) return;
  FreePages(seq);  // released while pinned: its last user gives its pages back
  retired_.erase(seq);
}

}  // namespace flashserve::kvcache
