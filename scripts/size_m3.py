"""Per-GPU memory of MiniMax-M3 RL (the sizing lives in rl/sizing.py; `--help` lists the flags):

    python scripts/size_m3.py [--recipe recipes/dapo_math_minimax_m31_flash.yaml] [--gpus 16] [--json out.json]
"""

from rl.sizing import main

if __name__ == "__main__":
    main()
