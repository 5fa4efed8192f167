// libFuzzer target: arbitrary text -> TuneCache::FromJson. A cache file is read at startup from
// a path an operator (or a crashed earlier run) wrote; it must never crash the server, only be
// ignored with a reason. Accepted text must survive ToJson -> FromJson unchanged (what Save
// writes, Load must read back), and Find must work on what was loaded.
#include <cstddef>
#include <cstdint>
#include <string>

#include "autotune/tune_cache.h"
#include "fuzz_check.h"
#include "nlohmann/json.hpp"

namespace {

// Known, reported bug stepped around so a campaign finds new ones (delete when fixed):
// TuneCache::FromJson reads the int fields with nlohmann's get<int>(), which static_casts a JSON
// float such as 1e20 to int: undefined behaviour (UBSan: "1e+20 is outside the range of
// representable values of type 'int'"). Reproducer: tests/fuzz/RESULTS.md.
bool HitsKnownIntCastBug(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto out_of_int_range = [](const nlohmann::json& v) {
    if (!v.is_number_float()) return false;
    const double d = v.get<double>();
    return !(d > -2147483649.0 && d < 2147483648.0);
  };
  auto field = [&](const nlohmann::json& object, const char* key) {
    return object.is_object() && object.contains(key) && out_of_int_range(object[key]);
  };
  if (j.contains("device")) {
    for (const char* key : {"cc_major", "cc_minor", "driver_version", "runtime_version"}) {
      if (field(j["device"], key)) return true;
    }
  }
  if (j.contains("entries") && j["entries"].is_structured()) {
    for (const auto& e : j["entries"]) {
      if (field(e, "candidates_timed")) return true;
    }
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  // The header the seed corpus (make_corpus.py) is written for.
  static const TuneCacheHeader header = [] {
    TuneCacheHeader h;
    h.device_name = "NVIDIA H100 80GB HBM3";
    h.cc_major = 9;
    h.cc_minor = 0;
    h.driver_version = 12040;
    h.runtime_version = 12040;
    h.build_id = "0123456789abcdef";
    return h;
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (HitsKnownIntCastBug(text)) return 0;
  TuneCache cache(header);
  const absl::Status status = cache.FromJson(text);
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kDataLoss ||
                   status.code() == absl::StatusCode::kFailedPrecondition,
               status.ToString());
    FUZZ_CHECK(!status.message().empty(), "error without a reason");
    FUZZ_CHECK(cache.size() == 0, "a rejected file left entries behind");
    return 0;
  }
  const std::string saved = cache.ToJson();
  TuneCache reloaded(header);
  const absl::Status again = reloaded.FromJson(saved);
  FUZZ_CHECK(again.ok(), "ToJson output does not load: " + again.ToString() + "\n" + saved);
  FUZZ_CHECK(reloaded.size() == cache.size(), "entry count changed on reload");
  FUZZ_CHECK(reloaded.ToJson() == saved, "ToJson -> FromJson -> ToJson is not a fixed point");
  static_cast<void>(cache.Find("sm90|bf16|d128|causal|gqa1|q4096|k4096"));
  return 0;
}
