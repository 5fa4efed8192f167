// A gRPC callback method's request and response on one protobuf arena per call
// (SetMessageAllocatorFor_<Method>): for messages of many small parts, where allocating and
// freeing each part one by one is a real share of the call (edge/sequences/sequences_arena.h).
#pragma once

#include "google/protobuf/arena.h"
#include "grpcpp/support/message_allocator.h"

namespace flashserve {

template <typename Request, typename Response>
class ArenaMessages final : public grpc::MessageAllocator<Request, Response> {
 public:
  explicit ArenaMessages(const google::protobuf::ArenaOptions& options) : options_(options) {}

  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    return new Holder(options_);
  }

 private:
  class Holder final : public grpc::MessageHolder<Request, Response> {
   public:
    explicit Holder(const google::protobuf::ArenaOptions& options) : arena_(options) {
      this->set_request(google::protobuf::Arena::CreateMessage<Request>(&arena_));
      this->set_response(google::protobuf::Arena::CreateMessage<Response>(&arena_));
    }
    void Release() override { delete this; }  // gRPC calls it once the call is over

   private:
    google::protobuf::Arena arena_;
  };

  const google::protobuf::ArenaOptions options_;
};

}  // namespace flashserve
