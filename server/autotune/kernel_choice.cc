#include "autotune/kernel_choice.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "autotune/cuda_tuning.h"
#include "autotune/decode_class.h"
#include "flashserve/kernels/cuda_attention.h"
#include "spdlog/spdlog.h"

namespace flashserve {

absl::StatusOr<std::unique_ptr<KernelChooser>> KernelChooser::Create(
    const KernelChoiceOptions& options, int device_index) {
  const std::string& mode = options.autotune;
  if (mode != "off" && mode != "background" && mode != "startup") {
    return absl::InvalidArgumentError(
        absl::StrCat("--autotune must be off, background or startup, got \"", mode, "\""));
  }
  auto chooser = std::unique_ptr<KernelChooser>(new KernelChooser());
  if (mode == "off" && options.tune_cache_path.empty()) return chooser;
  absl::StatusOr<DeviceIdentity> device = DescribeCudaDevice(device_index);
  if (!device.ok()) return device.status();
  chooser->identity_ = *device;
  chooser->cache_ = std::make_unique<TuneCache>(CacheHeaderFor(chooser->identity_));
  if (!options.tune_cache_path.empty()) {
    TuneCache::LoadReport report;
    if (absl::Status s = chooser->cache_->Load(options.tune_cache_path, &report); !s.ok()) {
      spdlog::warn("autotune: ignoring the tuning cache: {}", std::string(s.message()));
    } else {
      if (report.skipped > 0) spdlog::warn("autotune: {}", report.Warning(options.tune_cache_path));
      spdlog::info("autotune: {} tuned classes loaded from {}", chooser->cache_->size(),
                   options.tune_cache_path);
    }
  }
  if (mode == "off") return chooser;
  if (absl::Status s = chooser->StartTuner(options, device_index); !s.ok()) return s;
  return chooser;
}

absl::Status KernelChooser::StartTuner(const KernelChoiceOptions& options, int device_index) {
  // Tuning runs on its own stream at the lowest priority, one class at a time.
  cudaSetDevice(device_index);
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (cudaError_t e = cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, least);
      e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA tuning stream: ", cudaGetErrorString(e)));
  }
  cudaStream_t stream = stream_;
  const int sm_count = identity_.sm_count;
  device_index_ = device_index;
  BackgroundTuner::Options tuner_options;
  tuner_options.cache_path = options.tune_cache_path;
  tuner_options.max_classes = options.max_classes;
  tuner_ = std::make_unique<BackgroundTuner>(
      cache_.get(),
      [device_index, sm_count, stream](const ProblemClass& c) {
        cudaSetDevice(device_index);
        return TuneProblemClass(c, sm_count, stream);
      },
      tuner_options, options.on_event);
  if (options.autotune == "startup") {
    const std::vector<ProblemClass> classes = GridClasses(options.startup_grid, identity_);
    spdlog::info("autotune: tuning {} classes before reporting ready", classes.size());
    for (const ProblemClass& c : classes) tuner_->Enqueue(c);
    while (!tuner_->WaitIdle(absl::Milliseconds(100))) {
      if (options.stop_requested && options.stop_requested()) {
        return absl::CancelledError(absl::StrCat(
            "startup tuning stopped by a shutdown signal after ", cache_->size(), " classes"));
      }
    }
    spdlog::info("autotune: startup tuning done ({} classes cached)", cache_->size());
  }
  return absl::OkStatus();
}

KernelChooser::~KernelChooser() {
  tuner_.reset();  // joins the tuning thread before its stream goes away
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

bool KernelChooser::Covers(const DeviceIdentity& device) const {
  return cache_ != nullptr && device.name == identity_.name &&
         device.cc_major == identity_.cc_major && device.cc_minor == identity_.cc_minor &&
         device.sm_count == identity_.sm_count;
}

kernels::cuda::KernelConfig KernelChooser::Choose(const kernels::AttentionParams& params,
                                                  int sm_count, bool covered) const {
  const kernels::cuda::KernelConfig fallback = kernels::cuda::select(params, sm_count);
  if (!covered || cache_ == nullptr) return fallback;
  const ProblemClass c = ClassOf(params, identity_);
  std::optional<std::string> name;
  if (tuner_ && c.tunable_live(sm_count)) {
    name = tuner_->Lookup(c);
  } else if (std::optional<TuneRecord> record = cache_->Find(c.key())) {
    name = record->config;
  }
  if (!name) return fallback;
  std::optional<kernels::cuda::KernelConfig> tuned = kernels::cuda::KernelConfig::parse(*name);
  // A name this build does not have, or a config run() refuses for params: the class has no
  // varlen or layout bit, so its winner (tuned on the dense problem) may not run this one.
  if (!tuned || !kernels::cuda::runnable(params, *tuned)) return fallback;
  return *tuned;
}

int KernelChooser::DecodeSplits(const kernels::cuda::DecodeParams& p, int sm_count,
                                bool covered) const {
  const int fallback = kernels::cuda::decode_num_splits(p, sm_count);
  if (!covered || cache_ == nullptr) return fallback;
  const std::optional<DecodeClass> c = DecodeClassOf(DecodeShapeOf(p), identity_);
  if (!c) return fallback;
  const std::string key = c->key();
  std::optional<std::string> config;
  if (tuner_) {
    const int device = device_index_;
    cudaStream_t stream = stream_;
    config = tuner_->Lookup(key, [device, stream, cls = *c] {
      cudaSetDevice(device);
      return TuneDecodeClass(cls, stream);
    });
  } else if (std::optional<TuneRecord> record = cache_->Find(key)) {
    config = record->config;
  }
  return DecodeSplitsFromConfig(config, fallback);
}

int DecodeSplitsFor(const KernelChooser* chooser, const kernels::cuda::DecodeParams& p,
                    int sm_count, bool covered) {
  if (chooser == nullptr) return kernels::cuda::decode_num_splits(p, sm_count);
  return chooser->DecodeSplits(p, sm_count, covered);
}

}  // namespace flashserve
