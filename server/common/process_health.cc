#include "common/process_health.h"

#include <atomic>
#include <mutex>

#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

std::atomic<bool> broken{false};
std::mutex reason_mu;
std::string& Reason() {
  static auto* reason = new std::string();  // never destroyed: log callbacks may run at exit
  return *reason;
}

}  // namespace

void MarkProcessBroken(std::string_view why) {
  {
    std::lock_guard<std::mutex> lock(reason_mu);
    if (!Reason().empty()) return;
    Reason() = std::string(why);
  }
  broken.store(true);
  spdlog::critical("{}; reporting not live, the process will drain and exit 3 to be restarted",
                   why);
}

bool ProcessBroken() { return broken.load(); }

std::string ProcessBrokenReason() {
  std::lock_guard<std::mutex> lock(reason_mu);
  return Reason();
}

}  // namespace flashserve
