#include "decode_split.h"

#include <utility>

#include "loadgen_workload.h"

namespace flashserve::loadgen {
namespace {

constexpr char kEchoMethod[] = "/flashserve.bench.Echo/Echo";

// The first failed part's status as "part j: <code>: <message>"; true when none failed.
bool AllOk(const std::vector<grpc::Status>& statuses, const char* what, std::string* error) {
  for (size_t j = 0; j < statuses.size(); ++j) {
    if (statuses[j].ok()) continue;
    *error = std::string(what) + "part " + std::to_string(j) + ": " +
             std::to_string(int(statuses[j].error_code())) + ": " + statuses[j].error_message();
    return false;
  }
  return true;
}

// Fresh contexts for one step's calls (a ClientContext serves one call and cannot be moved).
std::vector<std::unique_ptr<grpc::ClientContext>> Contexts(size_t n, const std::string& token) {
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (size_t j = 0; j < n; ++j) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    Authorize(contexts.back().get(), token);
  }
  return contexts;
}

}  // namespace

void CallLatch::Done() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--pending_ == 0) all_done_.notify_one();
}

void CallLatch::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  all_done_.wait(lock, [this] { return pending_ == 0; });
}

SplitDecodeClient::SplitDecodeClient(const std::string& target, const std::string& token, int index,
                                     std::vector<const v1::DecodeStepRequest*> parts)
    : token_(token), parts_(std::move(parts)) {
  const int n = int(parts_.size());
  for (int j = 0; j < n; ++j)
    stubs_.push_back(v1::Sequences::NewStub(MakeChannel(target, index * n + j)));
}

bool SplitDecodeClient::Step(std::vector<v1::DecodeStepResponse>* responses, std::string* error) {
  const size_t n = parts_.size();
  responses->resize(n);  // kept between steps: a parse reuses their submessages
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts = Contexts(n, token_);
  std::vector<grpc::Status> statuses(n);
  CallLatch latch(n);
  for (size_t j = 0; j < n; ++j) {
    stubs_[j]->async()->DecodeStep(contexts[j].get(), parts_[j], &(*responses)[j],
                                   [&statuses, &latch, j](grpc::Status s) {
                                     statuses[j] = std::move(s);
                                     latch.Done();
                                   });
  }
  latch.Wait();
  return AllOk(statuses, "", error);
}

SplitEchoClient::SplitEchoClient(const std::string& target, const std::string& token, int index,
                                 std::vector<std::string> request_bytes,
                                 std::vector<int64_t> response_bytes)
    : token_(token),
      request_bytes_(std::move(request_bytes)),
      response_bytes_(std::move(response_bytes)),
      responses_(request_bytes_.size()) {
  const int n = int(request_bytes_.size());
  for (int j = 0; j < n; ++j) {
    stubs_.push_back(std::make_unique<grpc::GenericStub>(MakeChannel(target, index * n + j)));
    requests_.push_back(StaticBuffer(request_bytes_[size_t(j)]));
  }
}

bool SplitEchoClient::Step(std::string* error) {
  const size_t n = requests_.size();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts = Contexts(n, token_);
  std::vector<grpc::Status> statuses(n);
  CallLatch latch(n);
  for (size_t j = 0; j < n; ++j) {
    contexts[j]->AddMetadata("x-response-bytes", std::to_string(response_bytes_[j]));
    responses_[j].Clear();
    stubs_[j]->UnaryCall(contexts[j].get(), kEchoMethod, grpc::StubOptions(), &requests_[j],
                         &responses_[j], [&statuses, &latch, j](grpc::Status s) {
                           statuses[j] = std::move(s);
                           latch.Done();
                         });
  }
  latch.Wait();
  if (!AllOk(statuses, "echo: ", error)) return false;
  for (size_t j = 0; j < n; ++j) {
    if (int64_t(responses_[j].Length()) == response_bytes_[j]) continue;
    *error = "echo: part " + std::to_string(j) + " answered " +
             std::to_string(responses_[j].Length()) + " bytes, asked for " +
             std::to_string(response_bytes_[j]);
    return false;
  }
  return true;
}

}  // namespace flashserve::loadgen
