#include "memory/io_buffers.h"

#include <new>

namespace flashserve {

std::shared_ptr<IoBuffers> IoBuffers::Allocate(const AttentionProblem& problem, PinnedPool* pool) {
  return AllocateLayout(IoLayout::For(problem), pool);
}

std::shared_ptr<IoBuffers> IoBuffers::AllocateOutputs(const AttentionProblem& problem,
                                                      PinnedPool* pool) {
  std::shared_ptr<IoBuffers> io = AllocateLayout(IoLayout::OutputsOnly(problem), pool);
  if (io != nullptr) io->has_inputs_ = false;
  return io;
}

std::shared_ptr<IoBuffers> IoBuffers::AllocateLayout(const IoLayout& layout, PinnedPool* pool) {
  std::shared_ptr<IoBuffers> io(new IoBuffers(layout));
  if (pool != nullptr) {
    io->pinned_ = pool->Acquire(layout.total);
    if (io->pinned_) {
      io->page_locked_ = pool->options().page_locked;
      io->base_ = io->pinned_.data();
      return io;
    }
  }
  // Not zero-filled: every byte of q/k/v is written by the parser and of o/lse by the backend.
  io->base_ = static_cast<char*>(
      ::operator new(layout.total, std::align_val_t(IoLayout::kAlign), std::nothrow));
  if (io->base_ == nullptr) return nullptr;
  io->heap_ = true;
  return io;
}

IoBuffers::~IoBuffers() {
  if (heap_) ::operator delete(base_, std::align_val_t(IoLayout::kAlign));
}

}  // namespace flashserve
