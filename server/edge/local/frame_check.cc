#include "edge/local/frame_check.h"

#include "absl/strings/str_cat.h"

namespace flashserve {

namespace local = v1::local;

std::string_view LocalMethodName(uint16_t method) {
  switch (static_cast<local::Method>(method)) {
    case local::Method::kHello: return "Hello";
    case local::Method::kEcho: return "Echo";
    case local::Method::kAttention: return "Attention";
    case local::Method::kDecodeStep: return "DecodeStep";
    case local::Method::kAttend: return "Attend";
  }
  return {};
}

absl::Status CheckRequestHeader(const local::FrameHeader& header, int64_t max_payload_bytes) {
  if (header.magic != local::kMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local frame: bad magic 0x", absl::Hex(header.magic), " (want \"FSL1\")"));
  }
  if (LocalMethodName(header.method_or_status).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("local frame: unknown method ", header.method_or_status));
  }
  if (header.flags != 0 || header.reserved != 0) {
    return absl::InvalidArgumentError("local frame: flags and reserved must be 0");
  }
  if (int64_t{header.payload_bytes} > max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "local frame: payload of ", header.payload_bytes, " bytes is over the limit of ",
        max_payload_bytes, " (--local_max_frame_bytes)"));
  }
  return absl::OkStatus();
}

absl::Status SplitRequestFrame(std::string_view bytes, int64_t max_payload_bytes,
                               local::FrameHeader* header, std::string_view* payload) {
  if (bytes.size() < local::kHeaderBytes) {
    return absl::InvalidArgumentError("local frame: shorter than its 16-byte header");
  }
  *header = local::DecodeHeader(reinterpret_cast<const unsigned char*>(bytes.data()));
  if (absl::Status s = CheckRequestHeader(*header, max_payload_bytes); !s.ok()) return s;
  if (bytes.size() - local::kHeaderBytes != header->payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local frame: header says ", header->payload_bytes, " payload bytes, ",
        bytes.size() - local::kHeaderBytes, " follow"));
  }
  *payload = bytes.substr(local::kHeaderBytes);
  return absl::OkStatus();
}

}  // namespace flashserve
