// The sequences of the KV cache: their shapes, per-layer lengths and page tables, the page pool
// they share, limits, TTL eviction and release. The bytes themselves are the KvStore's.
//
// Every operation validates everything before it takes a page, and is all or nothing: on an
// error no sequence changed. A sequence in use by a running step is pinned: release or eviction
// then only hides it, and its pages return to the pool when the step ends.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvcache/kv_metrics.h"
#include "kvcache/kv_store.h"
#include "kvcache/kv_types.h"
#include "kvcache/page_allocator.h"

namespace flashserve::kvcache {

/// Query rows per sequence and step at most (the decode kernels' limit).
inline constexpr int kMaxQueryRows = 16;
/// Sanity bounds on a sequence's shape (metadata stays small).
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxHeads = 1024;
inline constexpr int kMaxHeadDim = 256;  // what any store serves at most

struct KvCacheOptions {
  int64_t capacity_bytes = 0;               // --kv_cache_bytes
  int page_tokens = 64;                     // --kv_page_tokens
  absl::Duration ttl = absl::Seconds(300);  // --sequence_ttl_s; zero: never evict
  int max_sequences = 4096;                 // --max_sequences
  int64_t max_sequence_tokens = 131072;     // --max_sequence_tokens (per layer)
  std::function<absl::Time()> clock;        // tests; empty: absl::Now

  /// INVALID_ARGUMENT naming the flag.
  absl::Status Check() const;
};

struct CreateRequest {
  SequenceShape shape;
  int64_t max_tokens = 0;  // 0: max_sequence_tokens
  std::string label;
  std::vector<LayerRows> prefix;  // at most one per layer
  // Empty, or 16..64 characters of [0-9A-Za-z_-] chosen by the client (sequences.proto
  // CreateSequenceRequest.create_token): a create whose token names a live sequence made with it
  // answers that sequence instead of making another (a retry after a lost answer).
  std::string create_token;
};

struct SequenceStatus {
  std::string id;
  std::string label;
  SequenceShape shape;
  std::vector<int64_t> lengths;  // per layer
  int64_t max_tokens = 0;
  absl::Duration idle;
  int64_t bytes = 0;  // pool bytes held
  // CreateSequence only: the request's create_token named this sequence, made by an earlier try;
  // nothing was created.
  bool already_created = false;
};

/// One sequence's part of a step: append k/v (rows may be 0) to `layer`, then attend q.
struct StepItem {
  std::string id;
  int layer = 0;
  HostRows q, k, v;
  int64_t expected_length = -1;  // as LayerRows::expected_length
};

/// What Append did: every layer's length after it, and the layers whose expected_length found
/// the rows already appended by an earlier try (left as they were).
struct AppendResult {
  std::vector<int64_t> lengths;
  std::vector<int> already_appended;
};

/// One sequence's part of a Truncate: its `layers` (empty: every layer) keep their first `length`
/// tokens.
struct TruncateItem {
  std::string id;
  int64_t length = 0;
  std::vector<int> layers;
};

/// What Truncate did to one item's sequence: every layer's length after it, and the tokens it
/// dropped (over the layers).
struct TruncateResult {
  std::vector<int64_t> lengths;
  int64_t dropped = 0;
};

struct CacheStats {
  int64_t sequences = 0;
  int64_t used_bytes = 0;
  int64_t capacity_bytes = 0;
  int64_t pages_used = 0;
  int64_t evictions = 0;
};

/// What a transport may echo of the ids a NOT_FOUND status of this layer misses (gRPC trailing
/// metadata, a local frame's message): its well-formed ids, comma-joined; empty for other statuses
/// or when no missing id is well-formed (sequence_id.h: malformed ids are never echoed).
std::string MissingSequenceIdList(const absl::Status& status);

class SequenceCache;

/// A prepared step: its rows are appended, its sequences pinned until this is destroyed.
/// `batch` lists the items in request order, out/lse left for the caller to set.
class StepPlan {
 public:
  StepPlan() = default;
  StepPlan(StepPlan&& other) noexcept;
  StepPlan& operator=(StepPlan&& other) noexcept;
  StepPlan(const StepPlan&) = delete;
  StepPlan& operator=(const StepPlan&) = delete;
  ~StepPlan();

  PagedBatch batch;
  // Per item of `batch`: its rows were already there (expected_length), not appended again.
  std::vector<bool> already_appended;

 private:
  friend class SequenceCache;
  void Unpin();
  SequenceCache* cache_ = nullptr;
  std::vector<void*> pinned_;  // SequenceCache::Sequence*
};

/// Thread-safe. Borrows the store (and metrics, may be null), which must outlive it.
/// While one lives on a thread, the cache's calls made on that thread give up -- at once and with
/// nothing done, DEADLINE_EXCEEDED -- where they would wait for another call (a step's pin, another
/// append, another create with the same token), and would_have_waited() says so. The edge tries a
/// control call this way first (on gRPC's thread, or on threads of its own for large ones) and
/// queues it for a waiting thread only when it must wait: calls that need not wait never queue
/// behind ones that do (four waiting Truncates held every other client's Create for as long as a
/// step pinned their sequence).
class NoWaitScope {
 public:
  NoWaitScope();
  ~NoWaitScope();
  NoWaitScope(const NoWaitScope&) = delete;
  NoWaitScope& operator=(const NoWaitScope&) = delete;
  bool would_have_waited() const;
};

class SequenceCache {
 public:
  static absl::StatusOr<std::unique_ptr<SequenceCache>> Create(const KvCacheOptions& options,
                                                               KvStore* store,
                                                               KvCacheMetrics* metrics);
  ~SequenceCache();

  /// A new sequence with its prefix written. RESOURCE_EXHAUSTED: no room or max_sequences;
  /// DEADLINE_EXCEEDED (nothing kept) when `deadline` passed while the prefix was written, unless
  /// a create with its token waits for it. With a create_token that names a live sequence made
  /// with it: that sequence, already_created (nothing taken; ALREADY_EXISTS when the request's
  /// settings differ from its). One still writing its prefix is waited for, at most until
  /// `deadline` (then DEADLINE_EXCEEDED). CANCELLED (nothing kept) when `cancelled` says so once
  /// the prefix is written: a client that went away would leave a sequence nobody can name.
  absl::StatusOr<SequenceStatus> CreateSequence(const CreateRequest& request,
                                                absl::Time deadline = absl::InfiniteFuture(),
                                                const std::function<bool()>& cancelled = {});
  /// Appends rows to one or more layers. ABORTED when a layer's expected_length is neither its
  /// length nor its length less the rows (nothing appended then). DEADLINE_EXCEEDED, nothing
  /// appended, when `deadline` passed while it waited for another append to the sequence.
  /// A wait also ends (CANCELLED, nothing appended) once `cancelled` says so. NOT_FOUND, as for
  /// an unknown id, also when a Release took the sequence while the rows were copied.
  absl::StatusOr<AppendResult> Append(std::string_view id, const std::vector<LayerRows>& rows,
                                      absl::Time deadline = absl::InfiniteFuture(),
                                      const std::function<bool()>& cancelled = {});
  /// Validates every item, appends their rows and pins their sequences. All items must share
  /// heads_q, heads_kv, head_dim and dtype; a (sequence, layer) may appear once. Items whose
  /// expected_length finds their rows already there are not appended again (ABORTED as Append;
  /// DEADLINE_EXCEEDED and CANCELLED as Append).
  absl::StatusOr<StepPlan> PrepareStep(const std::vector<StepItem>& items,
                                       absl::Time deadline = absl::InfiniteFuture(),
                                       const std::function<bool()>& cancelled = {});
  /// Whether an Append is copying rows into a sequence `items` name (PrepareStep would wait for
  /// it). Unknown ids count as idle. Takes no lock while no Append runs anywhere.
  bool AnyAppending(const std::vector<StepItem>& items);
  /// Returns once no Append copies rows into a sequence `items` name, or once `deadline` passes
  /// or `cancelled` (may be empty) says so: a step's caller waits here, on a thread of its own,
  /// instead of in PrepareStep on a scheduler worker that other clients' steps need.
  void AwaitAppends(const std::vector<StepItem>& items, absl::Time deadline,
                    const std::function<bool()>& cancelled);
  /// Cuts each item's layers back to their first `length` tokens; the pages wholly past the cut
  /// return to the pool. A layer already that short is left as it is (a retry). Waits, at most
  /// until `deadline` (then DEADLINE_EXCEEDED, nothing cut), while an append or a prepared step
  /// holds one of the sequences: a step sees the rows it was sent with. NOT_FOUND naming every
  /// missing id; ABORTED when a named layer holds fewer than `length` tokens; INVALID_ARGUMENT for
  /// a negative length, a layer out of range or named twice, a sequence named twice. All or
  /// nothing; results in the order of the items.
  /// A wait also ends (CANCELLED, nothing cut) once `cancelled` says so.
  absl::StatusOr<std::vector<TruncateResult>> Truncate(const std::vector<TruncateItem>& items,
                                                       absl::Time deadline = absl::InfiniteFuture(),
                                                       const std::function<bool()>& cancelled = {});
  /// Releases the sequences; returns the well-formed ids that were not found (an id named twice is
  /// released once and is not "not found" the second time; ids the server cannot have issued are
  /// skipped before any lookup). `released`, if given: how many were released.
  std::vector<std::string> Release(const std::vector<std::string>& ids,
                                   int64_t* released = nullptr);
  absl::StatusOr<SequenceStatus> Info(std::string_view id);
  CacheStats Stats();
  /// Evicts sequences idle past the TTL (not pinned ones); how many. Also runs by itself from
  /// the other calls, at most every TTL/8. While decode calls wait to run (CallWaiting), only
  /// sequences already idle past the TTL when the oldest of them arrived go: a waiting call's
  /// sequences were alive when it came, and it names them.
  int64_t EvictIdle();
  /// A decode call is queued (or batched) from now until CallLeft(the time returned): its
  /// sequences count as used at least until then (EvictIdle). Call CallLeft once its step is
  /// prepared (PrepareStep has marked them used) or it is answered without running.
  absl::Time CallWaiting();
  void CallLeft(absl::Time waiting_since);

  const KvCacheOptions& options() const { return options_; }
  KvStore* store() { return store_; }

 private:
  struct Sequence;
  friend class StepPlan;
  SequenceCache(const KvCacheOptions& options, KvStore* store, KvCacheMetrics* metrics);

  absl::Time Now() const { return options_.clock ? options_.clock() : absl::Now(); }
  Sequence* FindLocked(std::string_view id);  // needs mu_
  Sequence* FindLocked(const std::string& id);
  Sequence* LookUpLocked(const std::string& id);  // a well-formed id only
  absl::Status ValidateCreate(const CreateRequest& request) const;
  int64_t MaxTokensOf(const CreateRequest& request) const;  // 0 -> --max_sequence_tokens
  // The record of a new sequence for `request` (no pages yet).
  std::unique_ptr<Sequence> NewSequence(const CreateRequest& request, std::string id) const;
  // The ready sequence request.create_token names, or null when none does (no token, or its
  // sequence is gone). Waits, releasing mu_, while the create holding the token writes its prefix
  // (it may still fail and forget the token); DEADLINE_EXCEEDED once `deadline` passes meanwhile
  // (CANCELLED once `cancelled` says so). ALREADY_EXISTS when the sequence was made with other
  // settings than the request's.
  absl::StatusOr<Sequence*> FindCreatedLocked(const CreateRequest& request,
                                              std::unique_lock<std::mutex>* lock,
                                              absl::Time deadline,
                                              const std::function<bool()>& cancelled);  // needs mu_
  // ALREADY_EXISTS naming the first setting in which `request` differs from the create that made
  // `seq` (its shape, effective max_tokens, prefix rows per layer).
  absl::Status CheckSameCreate(const Sequence& seq, const CreateRequest& request) const;
  // The answer to a create whose token named `seq`: a use of it, already_created.
  SequenceStatus AnswerCreatedLocked(Sequence* seq);  // needs mu_
  // Writes the prefix outside the lock (the sequence is hidden: nobody can name it yet).
  absl::Status WritePrefix(Sequence* seq, const std::vector<LayerRows>& prefix,
                           std::vector<int64_t>* fresh);
  // Shows the admitted sequence once `written` is OK and neither has `deadline` passed nor was
  // the call `cancelled` (unless a create with its token waits for it); otherwise frees it (with
  // its token and the pages not reached in *fresh) and returns why. Wakes the creates waiting
  // for its token.
  absl::StatusOr<SequenceStatus> FinishCreate(Sequence* seq, absl::Status written,
                                              absl::Time deadline,
                                              const std::function<bool()>& cancelled,
                                              std::vector<int64_t>* fresh);
  // Also sets (*fresh_rows)[i]: the rows item i appends (0 when expected_length finds them there).
  absl::Status ValidateStep(const std::vector<StepItem>& items, const std::vector<Sequence*>& found,
                            std::vector<int64_t>* fresh_rows) const;
  absl::Status FindAll(const std::vector<StepItem>& items,
                       std::vector<Sequence*>* found);  // needs mu_
  // The sequences of `ids` into *found (null where missing); NOT_FOUND naming every missing id.
  absl::Status FindIds(const std::vector<std::string_view>& ids,
                       std::vector<Sequence*>* found);  // needs mu_
  // Pages to add to `seq`'s layer for it to hold `new_length` tokens.
  int64_t PagesToGrow(const Sequence& seq, int layer, int64_t new_length) const;
  // The pages a layer grows by, as a run that continues its last page (PageAllocator::Allocate).
  struct PageRun {
    int64_t after = -1;  // the layer's last page (byte offset); -1: it has none
    int64_t count = 0;
  };
  PageRun RunToGrow(const Sequence& seq, int layer, int64_t new_length) const;
  // Puts `seq` into the table, hidden and pinned, with the pages of `runs` taken into *fresh
  // (RESOURCE_EXHAUSTED: --max_sequences, or no room) and its token into tokens_.
  absl::Status AdmitLocked(std::unique_ptr<Sequence> seq, const std::vector<PageRun>& runs,
                           std::vector<int64_t>* fresh);  // needs mu_
  // Takes every run's pages of `page_bytes` (all or nothing), evicting idle sequences first if
  // that makes room -- never one of `in_use`, the sequences the call works on (pinned meanwhile:
  // however long ago the clock says they were used, they must not be freed under the call).
  // `fresh` gets the pages in the order GrowTable takes them (from its back): the callers grow
  // the runs' layers in the order of `runs`.
  absl::Status TakePages(int64_t page_bytes, const std::vector<PageRun>& runs,
                         const std::vector<Sequence*>& in_use,
                         std::vector<int64_t>* fresh);  // needs mu_
  // PrepareStep's appends: the rows of each item not `there` (expected_length found them), at its
  // layer's end, from `fresh` (pages already taken); no length moves unless every row landed.
  absl::Status WriteStepRows(const std::vector<StepItem>& items,
                             const std::vector<Sequence*>& found, const std::vector<bool>& there,
                             std::vector<int64_t>* fresh);
  // Appends rows at the layer's end, growing its page table from `fresh` (pages already taken).
  absl::Status WriteRows(Sequence* seq, int layer, const HostRows& k, const HostRows& v,
                         std::vector<int64_t>* fresh);
  // WriteRows in two halves, for Append to copy outside the lock: GrowTable (needs mu_) gives the
  // layer the pages for `rows` more tokens; CopyRows writes them at `from` (lengths unchanged).
  void GrowTable(Sequence* seq, int layer, int64_t rows, std::vector<int64_t>* fresh);
  absl::Status CopyRows(const Sequence& seq, int layer, int64_t from, const HostRows& k,
                        const HostRows& v);
  // The sequence `id` once no Append on it is running (waits, releasing mu_, at most until
  // `deadline` or `cancelled`: then it may still be appending); null: not found.
  Sequence* FindIdleLocked(std::string_view id, std::unique_lock<std::mutex>* lock,
                           absl::Time deadline, const std::function<bool()>& cancelled = {});
  // Every item's sequence once nothing holds any of them (no append, no prepared step: pins ==
  // 0), waiting at most until `deadline` (then DEADLINE_EXCEEDED) or `cancelled` (CANCELLED);
  // NOT_FOUND as FindAll.
  absl::Status FindUnpinnedLocked(const std::vector<TruncateItem>& items,
                                  std::unique_lock<std::mutex>* lock, absl::Time deadline,
                                  const std::function<bool()>& cancelled,
                                  std::vector<Sequence*>* found);
  // INVALID_ARGUMENT / ABORTED as Truncate says for item `index`; its layers to cut in *cut.
  absl::Status ValidateTruncate(const Sequence& seq, const TruncateItem& item, size_t index,
                                std::vector<int>* cut) const;
  // What Truncate asks, checked before it waits for the steps on its sequences (a malformed call
  // is refused at once): NOT_FOUND, and INVALID_ARGUMENT as ValidateTruncate says.
  absl::Status CheckTruncateLocked(const std::vector<TruncateItem>& items);
  // ValidateTruncate's checks of the item alone (not of the lengths, which steps in flight move).
  static absl::Status TruncateLayers(const Sequence& seq, const TruncateItem& item, size_t index,
                                     std::vector<int>* cut);
  // Drops `layer`'s tokens past `length`; the offsets of its pages wholly past it go to *freed.
  // Returns the tokens dropped.
  int64_t CutLayer(Sequence* seq, int layer, int64_t length, std::vector<int64_t>* freed);
  // Waits (mu_ held through `lock`) until an append ends or `deadline` passes; false once it has
  // passed or `cancelled` (may be empty) says so. Waits in slices that re-read Now() and
  // `cancelled`, so a test's clock or a client that left ends the wait too.
  bool WaitForAppendLocked(std::unique_lock<std::mutex>* lock, absl::Time deadline,
                           const std::function<bool()>& cancelled = {});
  // The same for any of the cache's conditions (`cv` waits on mu_).
  bool WaitLocked(std::condition_variable* cv, std::unique_lock<std::mutex>* lock,
                  absl::Time deadline, const std::function<bool()>& cancelled = {});
  // Validates an Append's rows against `seq`; the pages each layer taking rows grows by in
  // *runs (in the order of `rows`), the layers whose rows are already there (expected_length) in
  // *already.
  absl::Status ValidateAppend(const Sequence& seq, const std::vector<LayerRows>& rows,
                              std::vector<PageRun>* runs, std::vector<int>* already) const;
  // Ends an Append whose copy returned `written`: moves the lengths of `rows`' layers if every
  // row landed, unmarks and unpins `seq`; its lengths after in *lengths. NOT_FOUND (nothing
  // appended) when a Release took the sequence while the rows were copied.
  absl::Status EndAppendLocked(Sequence* seq, std::string_view id,
                               const std::vector<LayerRows>& rows, absl::Status written,
                               std::vector<int64_t>* lengths);  // needs mu_
  bool AnyAppendingLocked(const std::vector<StepItem>& items);  // needs mu_
  void Remove(Sequence* seq);     // needs mu_
  void FreePages(Sequence* seq);  // needs mu_
  void Unpin(const std::vector<void*>& pinned);
  // Drops one pin; the last one of a released sequence frees it (pages and record).
  void UnpinLocked(Sequence* seq);  // needs mu_
  void MaybeEvictLocked();  // needs mu_
  // When the oldest waiting decode call arrived (CallWaiting), or Now() when none waits.
  absl::Time OldestWaitingLocked() const;  // needs mu_
  int64_t EvictIdleLocked();               // needs mu_
  void PublishLocked();                    // needs mu_
  SequenceStatus StatusOf(const Sequence& seq) const;
  PagedItem ItemFor(const Sequence& seq, int layer, const HostRows& q) const;

  const KvCacheOptions options_;
  KvStore* const store_;
  KvCacheMetrics* const metrics_;
  // A std::mutex (not absl::Mutex) so that ThreadSanitizer sees it: the system's Abseil is not
  // instrumented. Guards everything below; the functions marked "needs mu_" run under it.
  std::mutex mu_;
  std::condition_variable appended_;  // a Sequence::appending went false
  std::atomic<int64_t> appends_running_{0};  // Sequences with appending set (read without mu_)
  std::condition_variable unpinned_;  // a Sequence::pins went to 0
  std::condition_variable settled_;   // a hidden (being created) sequence became ready or went
  PageAllocator pages_;
  std::unordered_map<std::string, std::unique_ptr<Sequence>> table_;
  // create_token -> the sequence of table_ made with it (hidden ones too). An entry leaves with
  // its sequence (Remove), so there are at most --max_sequences.
  std::unordered_map<std::string, Sequence*> tokens_;
  // create_token -> creates waiting (FindCreatedLocked) for the hidden sequence made with it.
  std::unordered_map<std::string, int> token_waiters_;
  // Released or evicted while pinned: freed by the last Unpin.
  std::unordered_map<Sequence*, std::unique_ptr<Sequence>> retired_;
  absl::Time last_sweep_;
  int64_t evictions_ = 0;
  std::multiset<absl::Time> waiting_since_;  // decode calls queued or batched (CallWaiting)
};

}  // namespace flashserve::kvcache
