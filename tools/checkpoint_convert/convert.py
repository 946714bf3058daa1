"""`megatron-opd convert` as a script: HF safetensors <-> megatron-core torch_dist checkpoints.

    python tools/checkpoint_convert/convert.py hf-to-mcore --hf DIR --out DIR --tp N --pp M [--verify]
    python tools/checkpoint_convert/convert.py mcore-to-hf --ckpt DIR --out DIR [--verify]

The code lives in the package (megatron_opd/convert/checkpoint.py); this entry point keeps the
converter's place in the layout and works from a source checkout without `pip install`.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_opd.convert.checkpoint import main

    sys.exit(main())
