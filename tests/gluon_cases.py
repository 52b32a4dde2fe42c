"""The shape matrix and floors the Gluon backward GPU tests share (tests/test_gluon_bwd_gpu.py,
test_gluon_weighted_bwd_gpu.py, and the differential threshold's through tests/gluon_diff_cases.py): odd
lengths, both masks, more keys than queries, GQA, D 64 / 128, bf16 / fp16."""

from __future__ import annotations

import torch

# the absolute floor of DESIGN.md section 6's rule, per dtype, times the reference's largest magnitude
FLOORS = {torch.float16: 1e-3, torch.bfloat16: 8e-3}

# (B, N, KV, H, H_kv, D, causal, dtype)
SHAPES = [
    (1, 1, 1, 2, 2, 64, True, torch.bfloat16),
    (2, 17, 17, 4, 2, 128, False, torch.float16),
    (2, 127, 127, 4, 1, 128, True, torch.bfloat16),
    (1, 200, 200, 4, 4, 64, False, torch.bfloat16),
    (2, 333, 333, 8, 2, 64, True, torch.float16),
    (1, 100, 300, 4, 4, 128, True, torch.bfloat16),   # KV > N: every row sees the first KV - N keys
    (1, 257, 600, 2, 1, 64, False, torch.float16),
    (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16),
]
