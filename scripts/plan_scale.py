"""Scale plan: Gefen vs AdamW for Llama 3 8B, 70B, 405B and MoE models at 8-1024 ranks, on the meta device.

    python scripts/plan_scale.py                          # small: 8B x fsdp x 8, 64, 1024 ranks (minutes)
    python scripts/plan_scale.py --full                   # 8B, 70B, 405B x fsdp, fsdp_tp, hsdp x 8..1024 ranks
    python scripts/plan_scale.py --flavors 8B --meshes fsdp --worlds 8,64,512
    python scripts/plan_scale.py --moe                    # DeepSeek-V3 671B, Qwen3 30B-A3B x EP 8, 64 x 64..1024

The plan itself is ``benchmarks.scale`` and, for mixture-of-experts models,
``benchmarks.scale_moe`` (their docstrings say what is computed and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: a folder of the checkout, not the wheel
from benchmarks.scale import main

if __name__ == "__main__":
    main()
