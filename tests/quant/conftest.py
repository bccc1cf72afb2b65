import os
import sys

# Test modules import their shared helpers as `quant_oracles`, whether pytest imports this folder
# as part of the `tests` package or as a rootless directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
