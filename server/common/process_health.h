// A fault outside the backend that leaves this process unable to serve for good -- gRPC's listener
// gave up accepting connections -- reported as not live (AttentionRuntime::live), so the process
// drains and exits 3 for its supervisor to restart it, as after a sticky device fault.
#pragma once

#include <string>
#include <string_view>

namespace flashserve {

/// Marks the process broken (logged critical once; the first reason is kept). Thread-safe.
void MarkProcessBroken(std::string_view why);
/// Whether MarkProcessBroken was called. Thread-safe.
bool ProcessBroken();
/// The first reason given; empty while not broken.
std::string ProcessBrokenReason();

}  // namespace flashserve
