// KernelConfig's text form (the autotuner cache key for a configuration).
#include "flashserve/kernels/kernel_config.h"

#include <cctype>
#include <string>

namespace flashserve::kernels::cuda {

namespace {
constexpr std::string_view kSm90Prefix = "sm90";
}  // namespace

std::string KernelConfig::name() const {
  return std::string(family == KernelFamily::kSm90 ? kSm90Prefix : "") + "m" +
         std::to_string(block_m) + "n" + std::to_string(block_n) + "w" + std::to_string(num_warps) +
         "s" + std::to_string(kv_stages) + (q_in_regs ? "q" : "") + (lazy_rescale ? "l" : "");
}

namespace {
// Parses "<tag><digits>" at pos; advances pos.
bool parse_field(std::string_view text, size_t& pos, char tag, int& value) {
  if (pos >= text.size() || text[pos] != tag) return false;
  ++pos;
  const size_t start = pos;
  long v = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos])) &&
         pos - start < 6) {
    v = v * 10 + (text[pos] - '0');
    ++pos;
  }
  if (pos == start || (text[start] == '0' && pos - start > 1)) return false;
  value = static_cast<int>(v);
  return true;
}
}  // namespace

std::optional<KernelConfig> KernelConfig::parse(std::string_view text) {
  KernelConfig cfg;
  size_t pos = 0;
  if (text.substr(0, kSm90Prefix.size()) == kSm90Prefix) {
    cfg.family = KernelFamily::kSm90;
    pos = kSm90Prefix.size();
  }
  if (!parse_field(text, pos, 'm', cfg.block_m) || !parse_field(text, pos, 'n', cfg.block_n) ||
      !parse_field(text, pos, 'w', cfg.num_warps) || !parse_field(text, pos, 's', cfg.kv_stages))
    return std::nullopt;
  cfg.q_in_regs = false;
  if (pos < text.size() && text[pos] == 'q') {
    cfg.q_in_regs = true;
    ++pos;
  }
  cfg.lazy_rescale = false;
  if (pos < text.size() && text[pos] == 'l') {
    cfg.lazy_rescale = true;
    ++pos;
  }
  if (pos != text.size()) return std::nullopt;
  return cfg;
}

}  // namespace flashserve::kernels::cuda
