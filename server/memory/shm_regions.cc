#include "memory/shm_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "memory/shm_fault_guard.h"

namespace flashserve {

// One registered region: its memory stays mapped (opened) until the last reference goes.
struct ShmRegistry::Region {
  ShmRegionInfo info;
  ShmMemory memory;  // what it is, whatever its name (overlap checks)
  std::string owner;
  char* data = nullptr;        // the region's first byte (system: mapping + offset)
  void* mapping = nullptr;     // system: what mmap returned
  size_t mapping_bytes = 0;
  bool pinned = false;         // system: page-locked through ShmDeviceAccess
  int fd = -1;                 // system: the object, kept open to see it shrink (fstat per lease)
  int guard = -1;              // system: the mapping's ShmFaultGuard slot
  ShmDeviceAccess* device = nullptr;
  std::atomic<int> leases{0};  // requests using it now

  // OK unless the object no longer covers the region or an access to it faulted (SIGBUS, see
  // shm_fault_guard.h): what the server read or wrote there since is not the client's.
  absl::Status Intact() const;

  ~Region() {
    if (fd >= 0) close(fd);
    if (info.type == ShmType::kSystem && mapping != nullptr) {
      if (pinned) device->UnpinHost(data);
      ShmFaultGuard::Unwatch(guard);
      munmap(mapping, mapping_bytes);
    } else if (info.type == ShmType::kCuda && data != nullptr) {
      device->CloseIpc(data, info.device);
    }
  }
};

namespace {

bool NameChar(char c) { return absl::ascii_isalnum(c) || c == '_' || c == '.' || c == '-'; }

absl::Status NotEnabled() {
  return absl::PermissionDeniedError(
      "shared memory is disabled on this server (start it with --allow_client_shm)");
}

absl::Status Unknown(absl::string_view name) {
  // A name registration would refuse was never registered; it is not quoted (it may be megabytes).
  if (!CheckRegionName(name).ok()) {
    return absl::NotFoundError(absl::StrCat(
        "no shared-memory region is registered under the name given (", name.size(),
        " bytes; names are 1 to 128 letters, digits, '_', '.' and '-')"));
  }
  return absl::NotFoundError(absl::StrCat("no shared-memory region \"", name, "\" is registered"));
}

// Whether the object behind `st` may be mapped: owned by the server's own uid unless
// --shm_any_uid (a server running as root could otherwise be told to read and write any user's
// objects, or its container runtime's).
absl::Status CheckObjectOwner(absl::string_view key, const struct stat& st, bool any_uid) {
  if (any_uid || st.st_uid == geteuid()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "shared-memory key \"", key, "\" belongs to uid ", st.st_uid, ", not to this server's uid ",
      geteuid(), " (start the server with --shm_any_uid to map other users' objects)"));
}

// Why shm_open failed, with the code that says what the client can do about it.
absl::Status OpenError(absl::string_view key, int err) {
  const std::string what = absl::StrCat("shared-memory key \"", key, "\"");
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(
          absl::StrCat(what, " does not exist (create it before registering)"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat("cannot open ", what, ": ", std::strerror(err)));
    case EWOULDBLOCK:
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": another process holds a lease on the object (fcntl F_SETLEASE); release it"));
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot open ", what, ": ", std::strerror(err), " (on the server)"));
    default:  // EINVAL (a directory), ELOOP (a symbolic link), ENXIO (a socket), ...
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not a shared-memory object (", std::strerror(err), ")"));
  }
}

// Maps [offset, offset + byte_size) of the shm object `key`, read-write.
absl::Status MapSystem(absl::string_view key, uint64_t offset, uint64_t byte_size, bool any_uid,
                       ShmRegistry::Region* region) {
  const std::string path(key);
  // O_NONBLOCK: an object another process holds a lease on (fcntl F_SETLEASE) would otherwise
  // hold this thread until the lease is broken, 45 s by default (/proc/sys/fs/lease-break-time);
  // a few such registrations held every gRPC thread, health included.
  const int fd = shm_open(path.c_str(), O_RDWR | O_NONBLOCK, 0);
  if (fd < 0) return OpenError(key, errno);
  struct stat st;
  absl::Status status;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    status = absl::InvalidArgumentError(absl::StrCat("shared-memory key \"", key,
                                                     "\" is not a shared-memory object"));
  } else {
    status = CheckObjectOwner(key, st, any_uid);
    if (status.ok()) {
      status = CheckSpan(absl::StrCat("region on key \"", key, "\""), offset, byte_size,
                         uint64_t(st.st_size));
    }
  }
  if (status.ok()) {
    // mmap needs a page-aligned offset: map from the page holding `offset`.
    const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
    const uint64_t start = offset / page * page;
    region->mapping_bytes = size_t(offset - start + byte_size);
    void* p = mmap(nullptr, region->mapping_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                   off_t(start));
    if (p == MAP_FAILED) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("cannot map shared-memory key \"", key, "\": ", std::strerror(errno)));
    } else {
      region->mapping = p;
      region->data = static_cast<char*>(p) + (offset - start);
      region->guard = ShmFaultGuard::Watch(p, region->mapping_bytes);
      if (region->guard < 0) {
        status = absl::ResourceExhaustedError(
            absl::StrCat("already ", ShmFaultGuard::kMaxWatched,
                         " system regions mapped (the most this "
                         "server watches for faults); unregister some first"));
      }
    }
  }
  if (status.ok()) {
    region->fd = fd;  // kept: a lease checks the object still covers the region
    region->memory = {ShmType::kSystem, uint64_t(st.st_dev), uint64_t(st.st_ino)};
  } else {
    close(fd);
  }
  return status;
}

}  // namespace

absl::Status ShmRegistry::Region::Intact() const {
  if (info.type != ShmType::kSystem) return absl::OkStatus();
  const char* what = nullptr;
  struct stat st;
  if (ShmFaultGuard::Faulted(guard)) {
    what = "an access to it faulted (its object was cut short, or /dev/shm could not back it)";
  } else if (fd >= 0 &&
             (fstat(fd, &st) != 0 || uint64_t(st.st_size) < info.offset + info.byte_size)) {
    what = "its object shrank below the region";
  }
  if (what == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "shared-memory region \"", info.name, "\" (key \"", info.key, "\"): ", what,
      "; nothing read from or written to it since counts: unregister it and register it again"));
}

const char* ShmTypeName(ShmType type) { return type == ShmType::kSystem ? "system" : "cuda"; }

TensorBytes ShmSpan::AsInput() const {
  TensorBytes t = TensorBytes::Contiguous(kind, data, bytes);
  t.device = device;
  return t;
}

TensorTarget ShmSpan::AsOutput() const {
  TensorTarget t{kind, data, bytes};
  t.device = device;
  return t;
}

absl::Status CheckRegionName(absl::string_view name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("region name: must be 1 to 128 characters");
  }
  for (char c : name) {
    if (!NameChar(c)) {
      return absl::InvalidArgumentError(
          "region name: only letters, digits, '_', '.' and '-' are allowed");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckShmKey(absl::string_view key) {
  absl::string_view rest = key;
  if (!rest.empty() && rest.front() == '/') rest.remove_prefix(1);
  bool ok = !rest.empty() && rest.size() <= 250 && rest != "." && rest != "..";
  for (char c : rest) ok = ok && NameChar(c);
  if (!ok) {
    return absl::InvalidArgumentError(
        "key: must be '/' and 1 to 250 characters of letters, digits, '_', '.' and '-'");
  }
  return absl::OkStatus();
}

absl::Status CheckSpan(absl::string_view what, uint64_t offset, uint64_t bytes, uint64_t size) {
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", offset, " + byte_size ",
                                                   bytes, " is beyond its ", size, " bytes"));
  }
  return absl::OkStatus();
}

namespace {

bool StartsBefore(const ShmUse* a, const ShmUse* b) {
  return std::tie(a->memory.type, a->memory.dev, a->memory.ino, a->position) <
         std::tie(b->memory.type, b->memory.dev, b->memory.ino, b->position);
}

std::string Where(const ShmUse& use) {
  return absl::StrCat(use.tensor, " (region \"", use.region, "\", offset ", use.offset, ", ",
                      use.bytes, " bytes)");
}

absl::Status Overlap(const ShmUse& output, const ShmUse& other) {
  return absl::InvalidArgumentError(absl::StrCat(
      Where(output), " overlaps ", Where(other),
      output.region == other.region ? "" : " (the two regions are the same shared memory)",
      ": a shared-memory output may share no byte with another tensor of the request"));
}

}  // namespace

ShmUse UseOf(const ShmSpan& span, const char* tensor, absl::string_view region, uint64_t offset,
             bool output) {
  return ShmUse{tensor,      std::string(region), offset, uint64_t(span.bytes),
                span.memory, span.position,       output};
}

absl::Status CheckShmOverlaps(const std::vector<ShmUse>& uses) {
  std::vector<const ShmUse*> sorted;
  bool any_output = false;
  for (const ShmUse& use : uses) {
    if (use.bytes == 0) continue;
    sorted.push_back(&use);
    any_output = any_output || use.output;
  }
  if (!any_output) return absl::OkStatus();
  // By memory, then start: a use overlaps an earlier one of its memory iff it starts before that
  // one's end, so only the earlier use (and output) reaching furthest needs keeping.
  std::sort(sorted.begin(), sorted.end(), StartsBefore);
  auto end = [](const ShmUse* use) { return use->position + use->bytes; };
  const ShmUse* reach = nullptr;         // null: none yet in this memory
  const ShmUse* output_reach = nullptr;  // null: no output yet in this memory
  for (const ShmUse* use : sorted) {
    if (reach != nullptr && !(reach->memory == use->memory)) reach = output_reach = nullptr;
    if (output_reach != nullptr && use->position < end(output_reach)) {
      return Overlap(*output_reach, *use);
    }
    if (use->output && reach != nullptr && use->position < end(reach)) return Overlap(*use, *reach);
    if (reach == nullptr || end(use) > end(reach)) reach = use;
    if (use->output && (output_reach == nullptr || end(use) > end(output_reach))) {
      output_reach = use;
    }
  }
  return absl::OkStatus();
}

ShmRegistry::ShmRegistry(ShmLimits limits, ShmDeviceAccess* device)
    : limits_(limits), device_(device) {}

ShmRegistry::~ShmRegistry() = default;

absl::Status ShmRegistry::CheckNew(absl::string_view name, uint64_t byte_size,
                                   absl::string_view owner) const {
  auto it = regions_.find(name);
  auto reserved = reserved_.find(name);
  if (it != regions_.end() || reserved != reserved_.end()) {
    // Another owner's region is not named to this one: only "taken".
    const std::string& by = it != regions_.end() ? it->second->owner : reserved->second;
    return absl::AlreadyExistsError(
        absl::StrCat("a shared-memory region \"", name, "\" is already registered",
                     by == owner ? " (unregister it first)" : ""));
  }
  if (const size_t n = regions_.size() + reserved_.size(); int(n) >= limits_.max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("already ", n, " shared-memory regions (--shm_max_regions)"));
  }
  if (byte_size > uint64_t(limits_.max_bytes)) {  // never fits: not "retry later" (503)
    return absl::InvalidArgumentError(absl::StrCat("byte_size ", byte_size,
                                                   " is more than --shm_max_bytes=",
                                                   limits_.max_bytes, " allows for all regions"));
  }
  if (byte_size > uint64_t(limits_.max_bytes - bytes_)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("registering ", byte_size, " more bytes would pass --shm_max_bytes=",
                     limits_.max_bytes, " (", bytes_, " registered)"));
  }
  return absl::OkStatus();
}

// Gives its name and bytes back unless Add took them over.
class ShmRegistry::Reservation {
 public:
  Reservation(ShmRegistry* registry, std::string name, int64_t bytes)
      : registry_(registry), name_(std::move(name)), bytes_(bytes) {}
  ~Reservation() {
    if (added_) return;
    std::lock_guard<std::mutex> lock(registry_->mu_);
    registry_->reserved_.erase(name_);
    registry_->bytes_ -= bytes_;
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  // Under mu_: the name becomes the region's, and the bytes stay counted as its.
  void MarkAdded() {
    registry_->reserved_.erase(name_);
    added_ = true;
  }

 private:
  ShmRegistry* const registry_;
  const std::string name_;
  const int64_t bytes_;
  bool added_ = false;
};

absl::StatusOr<std::unique_ptr<ShmRegistry::Reservation>> ShmRegistry::Reserve(
    absl::string_view name, uint64_t byte_size, absl::string_view owner) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = CheckNew(name, byte_size, owner); !s.ok()) return s;
  reserved_.emplace(std::string(name), std::string(owner));
  bytes_ += int64_t(byte_size);
  return std::make_unique<Reservation>(this, std::string(name), int64_t(byte_size));
}

void ShmRegistry::Add(std::shared_ptr<Region> region, std::unique_ptr<Reservation> reservation) {
  std::lock_guard<std::mutex> lock(mu_);
  reservation->MarkAdded();
  regions_.emplace(region->info.name, std::move(region));
}

absl::Status ShmRegistry::RegisterSystem(absl::string_view name, absl::string_view key,
                                         uint64_t offset, uint64_t byte_size,
                                         absl::string_view owner) {
  if (!limits_.allow) return NotEnabled();
  if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
  if (absl::Status s = CheckShmKey(key); !s.ok()) return s;
  if (!absl::StartsWith(absl::StripPrefix(key, "/"), limits_.key_prefix)) {
    return absl::PermissionDeniedError(absl::StrCat("key: must start with '/", limits_.key_prefix,
                                                    "' on this server (--shm_key_prefix)"));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  auto reservation = Reserve(name, byte_size, owner);  // before mapping or pinning anything
  if (!reservation.ok()) return reservation.status();
  auto region = std::make_shared<Region>();
  region->info = {std::string(name), ShmType::kSystem, std::string(key), offset, byte_size, -1};
  region->owner = std::string(owner);
  region->device = device_;
  if (absl::Status s = MapSystem(key, offset, byte_size, limits_.any_uid, region.get()); !s.ok())
    return s;
  region->pinned = device_ != nullptr && device_->PinHost(region->data, size_t(byte_size));
  Add(std::move(region), *std::move(reservation));
  return absl::OkStatus();
}

absl::Status ShmRegistry::RegisterCuda(absl::string_view name, absl::string_view raw_handle,
                                       int64_t device, uint64_t byte_size,
                                       absl::string_view owner) {
  if (!limits_.allow) return NotEnabled();
  if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  if (device < 0 || device > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: ", device, " is not a device"));
  }
  if (device_ == nullptr) {
    return absl::FailedPreconditionError(
        "CUDA shared memory needs the CUDA backend (this server computes on the CPU)");
  }
  auto reservation = Reserve(name, byte_size, owner);  // before opening anything
  if (!reservation.ok()) return reservation.status();
  auto region = std::make_shared<Region>();
  region->info = {std::string(name), ShmType::kCuda, "", 0, byte_size, int(device)};
  region->memory.type = ShmType::kCuda;
  region->owner = std::string(owner);
  region->device = device_;
  absl::StatusOr<void*> opened = device_->OpenIpc(raw_handle, int(device), size_t(byte_size));
  if (!opened.ok()) return opened.status();
  region->data = static_cast<char*>(*opened);
  Add(std::move(region), *std::move(reservation));
  return absl::OkStatus();
}

absl::Status ShmRegistry::Unregister(ShmType type, absl::string_view name,
                                     absl::string_view owner) {
  if (!limits_.allow) return NotEnabled();
  std::vector<std::shared_ptr<Region>> gone;  // unmapped after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::map<std::string, std::shared_ptr<Region>, std::less<>>::iterator> matches;
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    const Region& r = *it->second;
    if (r.owner != owner || (!name.empty() && it->first != name)) continue;
    if (name.empty() && r.info.type != type) continue;
    if (r.info.type != type) {
      return absl::InvalidArgumentError(absl::StrCat("region \"", name, "\" is a ",
                                                     ShmTypeName(r.info.type), " region"));
    }
    if (const int n = r.leases.load(); n > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared-memory region \"", it->first, "\" is in use by requests in flight (",
                       n, " tensor(s)); unregister it after they are answered"));
    }
    matches.push_back(it);
  }
  // None of the caller's by that name: nothing to do. Triton answers so (its clients unregister in
  // cleanup code that must not fail), and another owner's region of that name stays.
  if (matches.empty()) return absl::OkStatus();
  for (auto it : matches) {
    bytes_ -= int64_t(it->second->info.byte_size);
    gone.push_back(std::move(it->second));
    regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShmRegionInfo>> ShmRegistry::Status(ShmType type,
                                                               absl::string_view name,
                                                               absl::string_view owner) const {
  if (!limits_.allow) return NotEnabled();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ShmRegionInfo> out;
  for (const auto& [region_name, region] : regions_) {
    if (region->owner != owner || region->info.type != type) continue;
    if (!name.empty() && region_name != name) continue;
    out.push_back(region->info);
  }
  if (!name.empty() && out.empty()) return Unknown(name);
  return out;
}

absl::StatusOr<ShmSpan> ShmRegistry::Lease(absl::string_view name, uint64_t offset, uint64_t bytes,
                                           absl::string_view owner) const {
  absl::StatusOr<ShmSpan> whole = LeaseWhole(name, owner);
  if (!whole.ok()) return whole.status();
  return SubSpan(*whole, name, offset, bytes);
}

absl::StatusOr<ShmSpan> ShmRegistry::LeaseWhole(absl::string_view name,
                                                absl::string_view owner) const {
  if (!limits_.allow) return NotEnabled();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(name);
  if (it == regions_.end() || it->second->owner != owner) return Unknown(name);
  std::shared_ptr<Region> region = it->second;
  // Refused before any access: a shrunk object would fault, a faulted mapping is no longer the
  // client's memory.
  if (absl::Status s = region->Intact(); !s.ok()) return s;
  ShmSpan span;
  span.data = region->data;
  span.bytes = size_t(region->info.byte_size);
  span.type = region->info.type;
  span.device = region->info.device;
  span.memory = region->memory;
  span.position = region->info.type == ShmType::kCuda ? reinterpret_cast<uintptr_t>(region->data)
                                                      : region->info.offset;
  span.kind = region->info.type == ShmType::kCuda ? MemoryKind::kDevice
              : region->pinned                    ? MemoryKind::kPageLocked
                                                  : MemoryKind::kHeap;
  region->leases.fetch_add(1);
  span.lease = std::shared_ptr<void>(region.get(), [region](void*) { region->leases.fetch_sub(1); });
  return span;
}

absl::Status ShmRegistry::CheckLease(const std::shared_ptr<void>& lease) {
  if (lease == nullptr) return absl::OkStatus();
  return static_cast<const Region*>(lease.get())->Intact();
}

absl::StatusOr<ShmSpan> ShmRegistry::SubSpan(const ShmSpan& whole, absl::string_view name,
                                             uint64_t offset, uint64_t bytes) {
  if (offset > whole.bytes || bytes > whole.bytes - offset) {
    return CheckSpan(absl::StrCat("shared-memory region \"", name, "\""), offset, bytes,
                     whole.bytes);
  }
  ShmSpan span = whole;
  span.data = whole.data + offset;
  span.bytes = size_t(bytes);
  span.position = whole.position + offset;
  return span;
}

int ShmRegistry::region_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int(regions_.size());
}

void ShmRegistry::Totals(ShmType type, int64_t* count, int64_t* bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  *count = 0;
  *bytes = 0;
  for (const auto& [name, region] : regions_) {
    if (region->info.type != type) continue;
    ++*count;
    *bytes += int64_t(region->info.byte_size);
  }
}

int64_t ShmRegistry::region_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace flashserve
