// libFuzzer target for the KServe REST body reader (server/edge/http/infer_body.h), differential:
// the same body, in fuzz_kserve_rest's input format (JSON header [ '\0' binary bytes ]; a second
// NUL right after the first: a chunked body), is fed four ways -- whole and in pieces of random
// sizes, with its header parsed inline as soon as it is whole and stashed-then-parsed at Finish
// (the path of large headers, parsed off the listener thread) -- and every way must give the same
// status and the same request, and give its receive budget back.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "edge/http/infer_body.h"
#include "fuzz_check.h"

namespace {

using namespace flashserve;

struct Outcome {
  absl::Status status;
  std::string request;  // the parsed request, serialized (empty unless OK)
  size_t outputs = 0;
};

struct Body {
  absl::string_view text;
  int64_t header_length = -1;  // -1: the whole body is JSON
  bool chunked = false;
};

Body Split(const uint8_t* data, size_t size, std::string* joined) {
  const char* begin = reinterpret_cast<const char*>(data);
  const char* nul = static_cast<const char*>(std::memchr(begin, '\0', size));
  Body body;
  if (nul == nullptr) {
    body.text = absl::string_view(begin, size);
    return body;
  }
  body.header_length = nul - begin;
  absl::string_view binary(nul + 1, size - size_t(body.header_length) - 1);
  if (!binary.empty() && binary.front() == '\0') {
    binary.remove_prefix(1);
    body.chunked = true;
  }
  joined->assign(begin, size_t(body.header_length));
  joined->append(binary.data(), binary.size());
  body.text = *joined;
  return body;
}

Outcome Read(const Body& body, bool stash, uint32_t piece_seed) {
  static const ValidationLimits validation = fuzz::CpuLimits(1 << 16);
  auto budget = std::make_shared<ReceiveBudget>(int64_t{1} << 30);
  KServeRestLimits limits;
  limits.max_request_bytes = 1 << 20;
  limits.max_json_bytes = 1 << 20;
  limits.budget = budget;
  limits.inline_parse_bytes = stash ? 0 : int64_t{1} << 40;
  Outcome out;
  {
    BudgetHold hold(budget);
    InferBodyReader reader(body.header_length, body.chunked ? -1 : int64_t(body.text.size()),
                           limits, &validation, &hold);
    out.status = reader.CheckHeaderLength();
    std::minstd_rand pieces(piece_seed);
    for (size_t at = 0; out.status.ok() && at < body.text.size();) {
      const size_t n = piece_seed == 0 ? body.text.size() - at
                                       : std::min<size_t>(1 + pieces() % 97, body.text.size() - at);
      out.status = reader.Consume(body.text.data() + at, n);
      at += n;
    }
    if (out.status.ok()) {
      if (!stash) FUZZ_CHECK(!reader.ParsesLater(), "parsed later under the inline limit");
      if (stash && body.header_length < 0) {
        FUZZ_CHECK(reader.ParsesLater(), "a whole-JSON body over the inline limit parsed inline");
      }
      out.status = reader.Finish();
    }
    if (out.status.ok()) {
      out.request = reader.request().request.SerializeAsString();
      out.outputs = reader.request().outputs.size();
    }
  }
  FUZZ_CHECK(budget->used() == 0, "the reader kept receive budget after it was gone");
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string joined;
  const Body body = Split(data, size, &joined);
  const uint32_t seed = 1 + uint32_t(std::hash<std::string_view>{}(
                                std::string_view(body.text.data(), body.text.size())) % 1000003);
  const Outcome base = Read(body, /*stash=*/false, /*piece_seed=*/0);
  for (const bool stash : {false, true}) {
    for (const uint32_t piece_seed : {uint32_t{0}, seed}) {
      if (!stash && piece_seed == 0) continue;  // that is `base`
      const Outcome other = Read(body, stash, piece_seed);
      const std::string how = std::string(stash ? "stashed" : "inline") +
                              (piece_seed ? ", in pieces" : ", whole");
      FUZZ_CHECK(other.status.code() == base.status.code(),
                 how + ": " + other.status.ToString() + " vs " + base.status.ToString());
      FUZZ_CHECK(other.request == base.request, how + ": another request");
      FUZZ_CHECK(other.outputs == base.outputs, how + ": other outputs");
    }
  }
  return 0;
}
