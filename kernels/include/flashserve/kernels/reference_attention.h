// Naive attention references for tests: fp64, and an emulation of a low-precision kernel.
#pragma once

#include <vector>

#include "flashserve/kernels/attention_params.h"

namespace flashserve::kernels::reference {

/// Exact attention in double precision, straight from the definition (no tiling).
/// Reads p.q/p.k/p.v with p's strides and dtype (p.o and p.lse are ignored).
/// out: [batch, seqlen_q, heads_q, head_dim] contiguous; lse: [batch, heads_q, seqlen_q]
/// (natural log; -inf for a row that sees no key, whose output is 0).
void attention_fp64(const AttentionParams& p, std::vector<double>* out, std::vector<double>* lse);

/// Like attention_fp64, but rounds the way a FlashAttention-style kernel in p.dtype does:
/// scores and row sums in fp32, unnormalized probabilities P rounded to p.dtype before P @ V,
/// fp32 accumulation, output rounded to p.dtype. Its error against attention_fp64 is the
/// yardstick for a kernel's tolerance ("at most 2x the error of a same-precision reference").
void attention_emulated(const AttentionParams& p, std::vector<double>* out, std::vector<double>* lse);

}  // namespace flashserve::kernels::reference
