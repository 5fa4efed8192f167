// Slots of a device counter pool, lent to launches so that two launches running at once never
// count on the same counters. Two kernels use such pools: the sm90 family's dynamic tile
// schedule (sm90/scheduler.h) and the decode kernel's in-kernel merge (decode/decode_merge.h).
// Each launch leaves its counters at zero, so a slot may pass to the next launch on the same
// stream at once (stream order: it starts after the previous one ends; the decode kernel's
// programmatic dependent launch waits for it before counting) and to another stream only once
// the event recorded after its last launch has completed.
//
// Slots were handed out round-robin before (sm90 until session 27, decode in 44ca9a6): a stream
// that queues as many launches as there are slots while another stream's launch runs then gets
// that launch's slot, and both count on the same counters: tiles skipped or run twice, merges
// too early or never. The server runs many streams per GPU plus a background tuner.
#pragma once

#include <cuda_runtime_api.h>

namespace flashserve::kernels::cuda {

/// A slot lent to one launch, or none (slot < 0): the launch then runs without the pool's
/// counters (a static schedule, a combine kernel).
struct CounterSlot {
  const void* pool = nullptr;  // the pool's device address (with device, its identity)
  int device = 0;
  int slot = -1;
  unsigned long long stream_id = 0;  // cudaStreamGetId of the launch's stream
};

/// A slot of the pool at device address `pool` (num_slots slots, on the current device) for
/// the next launch on `stream`: the slot this stream used last, else a slot no launch has used
/// or whose last launch has completed. None when every slot is busy on other streams, when the
/// stream is capturing a graph (a replay's time is unknown) or on a runtime error. Every slot
/// returned must be passed to release_counter_slot once the launch is queued (or failed).
CounterSlot acquire_counter_slot(const void* pool, int num_slots, cudaStream_t stream);

/// Ends the loan of s: launched, an event recorded on stream marks when its launch ends;
/// otherwise the slot stays as it was before the acquire.
void release_counter_slot(const CounterSlot& s, cudaStream_t stream, bool launched);

/// The slot the calling thread's last launch through a pool took (-1: none, or a launch that
/// ran without one), set by the launch code (sm90 dynamic schedule, decode in-kernel merge):
/// tests check which launches shared a slot.
int& last_counter_slot();

}  // namespace flashserve::kernels::cuda
