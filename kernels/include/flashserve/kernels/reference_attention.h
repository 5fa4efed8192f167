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

/// How the emulated kernel walks the keys and rescales its online softmax; this decides which
/// running max each unnormalized probability P is computed against, hence how it rounds.
struct EmulationOptions {
  /// Keys per block (the kernel's block_n); blocks are [j * block_n, (j + 1) * block_n).
  /// 0: one pass against the row's final max (every P <= 1, the row max's P exactly 1).
  int block_n = 0;
  /// Visit the key blocks from the last one backwards (as the sm80 CUDA kernels do).
  bool backwards = true;
  /// Online-softmax rescale threshold in the log2 domain: the running max m (and with it O and
  /// the row sum) moves to a block's larger max only when that grows m by more than this;
  /// otherwise P = 2^(s - m) uses the stale m and can reach 2^threshold. 0: every growth
  /// rescales (FlashAttention-2). Ignored when block_n is 0.
  float rescale_threshold_log2 = 0.f;
};

/// Like attention_fp64, but rounds the way a FlashAttention-style kernel in p.dtype does:
/// scores and row sums in fp32, unnormalized probabilities P rounded to p.dtype before P @ V,
/// fp32 accumulation (rescaled in fp32 when the running max moves), output rounded to p.dtype.
/// Its error against attention_fp64 is the yardstick for a kernel's tolerance ("at most 2x the
/// error of a same-precision reference"); options say where the kernel's P is rounded.
void attention_emulated(const AttentionParams& p, const EmulationOptions& options,
                        std::vector<double>* out, std::vector<double>* lse);
/// attention_emulated(p, EmulationOptions{}, out, lse): P against the final row max.
void attention_emulated(const AttentionParams& p, std::vector<double>* out, std::vector<double>* lse);

}  // namespace flashserve::kernels::reference
