#!/usr/bin/env python3
"""Train the tiny GPT under packet loss and compare with the lossless run.

    python tools/loss_sweep.py [--out-dir loss_sweep] [--iters 80] [--quick] [--markdown]
                               [--rates 0.01,0.05,0.1] [--traffic pipeline,tp,...] [--models bernoulli,...]
                               [--num-layers 4]

Grid: loss rates 0, 1%, 5%, 10% x (bernoulli, gilbert-elliott with mean burst --burst-length) x traffic:
  pipeline       P=2, --loss-on forward,backward (activations and gradients between the stages);
  tp             T=2, --loss-on tp on every tensor-parallel site except vocab-parallel cross-entropy
                 (--loss-tp-sites without cross_entropy / fused_cross_entropy): the layers' own traffic;
  tp_all_sites   T=2, --loss-on tp on all sites ("tp (T=2) incl. cross-entropy" in the table). Cross-entropy's
                 all-reduces (max logit, predicted logit, sum of exponentials: one packet each per microbatch) can
                 turn the loss itself into NaN or -inf when lost (a zeroed sum of exponentials gives log 0 under the
                 zeros fill); such runs print as "diverged (NaN at iter k)".
Every run starts from the same seed and data, so differences come from the loss alone; both tp groups share one
lossless run. Writes <out-dir>/loss_sweep.json and loss_sweep.png (loss curves; non-finite points are left out) and
prints the table of final loss (mean of the last --tail iterations) against the lossless run of the same layout.
--quick: 0 and 10%, bernoulli only, 4 iterations (a smoke test). --num-layers 8 is the trainer's default model size
(the 4-layer default keeps the README's first table reproducible); --rates, --traffic and --models narrow or widen
the grid, e.g. a pipeline-only sweep down to where learning resumes.
"""

import sys

from megatron_app.bench.loss_sweep import main

if __name__ == "__main__":
    sys.exit(main())
