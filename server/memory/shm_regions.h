// Clients' shared-memory regions (Triton's shared-memory extension): the registry of named
// regions a co-located client registered, and the leases requests hold on them.
//
// A system region is a POSIX shared-memory object (shm_open key) mapped once at registration;
// a CUDA region is another process's device memory opened once from its cudaIpcMemHandle. What
// needs a GPU (page-locking a system region, opening an IPC handle) is done by the backend through
// ShmDeviceAccess (runtime/); the registry only keeps the rules:
//   - off unless enabled (--allow_client_shm); names and keys validated;
//   - limits on the number of regions and their bytes (--shm_max_regions, --shm_max_bytes);
//   - a reference (offset, byte size) must lie inside its region, overflow-checked;
//   - a call's output may share no byte with its other tensors (CheckShmOverlaps), compared in the
//     memory (ShmMemory) rather than by region names, which a client may alias;
//   - a region used by a request cannot go away under it: Unregister of a region with leases
//     fails (FAILED_PRECONDITION, naming the count) and leaves it registered. Edges drop a
//     request's leases before they answer, so a client that unregisters after its answer never
//     sees this;
//   - a region whose object the client cuts short while the server uses it does not crash the
//     server (shm_fault_guard.h): the requests using it fail and the region is refused after;
//   - a region belongs to the owner that registered it: another owner can neither see, use nor
//     unregister it. Every edge passes "" today (the server has one bearer token, so every
//     authorized caller is the same owner); the parameter is where per-client owners would go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "memory/tensor_bytes.h"

namespace flashserve {

/// What a backend does for regions (runtime/ implements it; the CPU backend has none).
/// Thread-safe.
class ShmDeviceAccess {
 public:
  virtual ~ShmDeviceAccess() = default;
  /// Page-locks a mapped system region for DMA (cudaHostRegister); false: left pageable.
  virtual bool PinHost(void* data, size_t bytes) = 0;
  virtual void UnpinHost(void* data) = 0;
  /// Opens a cudaIpcMemHandle (raw bytes) on `device`, whose allocation must hold `bytes`; a
  /// clear error for a bad handle, a device that is not this server's, an allocation too small.
  virtual absl::StatusOr<void*> OpenIpc(absl::string_view raw_handle, int device,
                                        size_t bytes) = 0;
  virtual void CloseIpc(void* base, int device) = 0;
};

enum class ShmType { kSystem, kCuda };
/// "system" / "cuda" (messages, metrics).
const char* ShmTypeName(ShmType type);

struct ShmLimits {
  bool allow = false;                         // --allow_client_shm
  int max_regions = 64;                       // --shm_max_regions (both types together)
  int64_t max_bytes = int64_t{64} << 30;      // --shm_max_bytes (both types together)
  // System regions: only keys starting with this (after the '/'), e.g. "flashserve_" -- the
  // server's uid (root, often) may open objects that are none of its clients' business.
  std::string key_prefix;                     // --shm_key_prefix ("": any key)
  bool any_uid = false;                       // --shm_any_uid (false: the server's uid only)
};

/// A region's description, as the status calls report it.
struct ShmRegionInfo {
  std::string name;
  ShmType type = ShmType::kSystem;
  std::string key;      // system: the shm_open key
  uint64_t offset = 0;  // system: where the region starts in the object
  uint64_t byte_size = 0;
  int device = -1;      // cuda: the device the memory is on
};

/// Which memory a region is, whatever name it was registered under: two names for one shm object
/// (or one CUDA allocation) give the same ShmMemory, so overlaps are found through aliases.
/// System: the object's (st_dev, st_ino), unique while the registry holds it open. CUDA: the
/// process's one address space (a handle opened twice gives the same pointer; driver 580 checked).
struct ShmMemory {
  ShmType type = ShmType::kSystem;
  uint64_t dev = 0, ino = 0;  // system only
  bool operator==(const ShmMemory& o) const {
    return type == o.type && dev == o.dev && ino == o.ino;
  }
};

/// A lease on part of a region: the memory stays mapped (and the region registered) while one
/// exists. Copyable; the last copy gives the lease back.
struct ShmSpan {
  std::shared_ptr<void> lease;
  char* data = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHeap;
  int device = -1;
  ShmType type = ShmType::kSystem;
  ShmMemory memory;
  uint64_t position = 0;  // where `data` is in `memory`: system: its offset in the object;
                          // cuda: its device address

  TensorBytes AsInput() const;
  TensorTarget AsOutput() const;
};

/// Thread-safe.
class ShmRegistry {
 public:
  /// `device` may be null (no GPU: system regions stay pageable, CUDA regions are refused).
  ShmRegistry(ShmLimits limits, ShmDeviceAccess* device);
  ~ShmRegistry();
  ShmRegistry(const ShmRegistry&) = delete;
  ShmRegistry& operator=(const ShmRegistry&) = delete;

  absl::Status RegisterSystem(absl::string_view name, absl::string_view key, uint64_t offset,
                              uint64_t byte_size, absl::string_view owner);
  absl::Status RegisterCuda(absl::string_view name, absl::string_view raw_handle, int64_t device,
                            uint64_t byte_size, absl::string_view owner);
  /// `name` empty: every region of `type` the owner has (none is removed if one is in use).
  absl::Status Unregister(ShmType type, absl::string_view name, absl::string_view owner);
  /// `name` empty: every region of `type` the owner has; NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<ShmRegionInfo>> Status(ShmType type, absl::string_view name,
                                                    absl::string_view owner) const;
  /// A lease on [offset, offset + bytes) of region `name` (any type).
  absl::StatusOr<ShmSpan> Lease(absl::string_view name, uint64_t offset, uint64_t bytes,
                                absl::string_view owner) const;
  /// A lease on the whole of region `name`: one lookup and object check for a call that takes
  /// many spans of it (SubSpan them).
  absl::StatusOr<ShmSpan> LeaseWhole(absl::string_view name, absl::string_view owner) const;
  /// [offset, offset + bytes) of `whole` (a LeaseWhole of region `name`), sharing its lease;
  /// INVALID_ARGUMENT naming the region when beyond it.
  static absl::StatusOr<ShmSpan> SubSpan(const ShmSpan& whole, absl::string_view name,
                                         uint64_t offset, uint64_t bytes);
  /// OK unless the region of `lease` (a ShmSpan's) stopped being the client's memory while the
  /// lease was held: its object shrank, or an access faulted (shm_fault_guard.h). Edges check the
  /// leases of a call before answering it: what the call read there was not the client's data
  /// and what it wrote there never reaches the client, so it must not be answered OK.
  /// FAILED_PRECONDITION naming the region (which stays refused until registered again).
  static absl::Status CheckLease(const std::shared_ptr<void>& lease);

  bool enabled() const { return limits_.allow; }
  int region_count() const;
  /// Registered bytes, and those of registrations still mapping.
  int64_t region_bytes() const;
  /// Regions of one type and their bytes, over every owner (metrics).
  void Totals(ShmType type, int64_t* count, int64_t* bytes) const;

  struct Region;  // shm_regions.cc

 private:
  class Reservation;  // a name and bytes held while a registration maps (shm_regions.cc)

  absl::Status CheckNew(absl::string_view name, uint64_t byte_size,
                        absl::string_view owner) const;  // under mu_
  /// Takes the name, a region slot and the bytes before anything is mapped or pinned: concurrent
  /// registrations that all passed a check made under the lock, then each mapped and pinned up
  /// to --shm_max_bytes before one of them won, could page-lock many times the limit at once.
  absl::StatusOr<std::unique_ptr<Reservation>> Reserve(absl::string_view name,
                                                       uint64_t byte_size,
                                                       absl::string_view owner);
  void Add(std::shared_ptr<Region> region, std::unique_ptr<Reservation> reservation);

  const ShmLimits limits_;
  ShmDeviceAccess* const device_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Region>, std::less<>> regions_;  // guarded by mu_
  std::map<std::string, std::string, std::less<>> reserved_;  // name -> owner; guarded by mu_
  int64_t bytes_ = 0;  // registered and reserved; guarded by mu_
};

/// One tensor of a call in a region, as the call named it, for CheckShmOverlaps.
struct ShmUse {
  const char* tensor = "";  // a literal: "O", "out_shm"
  std::string region;       // the name the call used
  uint64_t offset = 0, bytes = 0;
  ShmMemory memory;
  uint64_t position = 0;  // ShmSpan::position
  bool output = false;
};
/// `span` (leased from `region` at `offset`) as a use of the call.
ShmUse UseOf(const ShmSpan& span, const char* tensor, absl::string_view region, uint64_t offset,
             bool output);
/// INVALID_ARGUMENT naming both tensors when an output shares a byte of memory with another use
/// (an input or another output), whatever names the regions were given: a kernel may read an input
/// after it wrote the output there. Inputs may overlap one another (they are only read).
absl::Status CheckShmOverlaps(const std::vector<ShmUse>& uses);

/// OK for a region name: 1..128 characters of [A-Za-z0-9_.-].
absl::Status CheckRegionName(absl::string_view name);
/// OK for a shm_open key: an optional leading '/', then 1..250 characters of [A-Za-z0-9_.-]
/// (no other '/': a key never reaches outside /dev/shm).
absl::Status CheckShmKey(absl::string_view key);
/// OK when [offset, offset + bytes) lies in [0, size), computed without overflow.
absl::Status CheckSpan(absl::string_view what, uint64_t offset, uint64_t bytes, uint64_t size);

}  // namespace flashserve
